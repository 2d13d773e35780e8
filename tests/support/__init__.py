"""What several tests share besides conftest.py's fixtures: the pods of
k8s/ as their controllers make them (k8s_pods), network namespaces and a
lossy link between them (netns, lossy_link), Kubeflow Trainer's status
endpoint (status_server), training with tensorflow-datasets' mock data
(mock_cifar10_train), and the entry points run as a user without root's
rights (unprivileged). Imported as `support.NAME`: tests/ is on sys.path
(pytest.ini's pythonpath)."""
