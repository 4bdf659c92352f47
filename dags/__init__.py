"""The pipeline's DAG files; installed as the package eagle3_dags (`eagle3 dags-folder` prints the folder)."""
