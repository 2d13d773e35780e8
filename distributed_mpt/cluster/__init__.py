"""What a run learns from its cluster and tells it: where this process sits
among the workers (environment.py: TF_CONFIG, JobSet, an indexed Job,
SLURM), the `tf.distribute` strategy over them (strategy.py), and the
progress a Kubeflow TrainJob shows (trainjob_progress.py). It imports only
itself and the leaves (errors.py, files.py): it knows nothing of models or
training."""
