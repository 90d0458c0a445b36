"""Reads an MLflow file store back with the mlflow package, for ferl's `mlflow` logger test (tests/tests/loggers.rs).

Usage: mlflow_read.py TRACKING_URI EXPERIMENT_NAME
Prints one JSON object: the experiment (`experiment_id`, `name`, `lifecycle_stage`) and its runs, each with `run_id`,
`run_name`, `status`, `start_time`, `end_time`, `params`, `tags`, and `metrics` as {name: [[step, value], ...]} from
`MlflowClient.get_metric_history` (in step order).
"""
import json
import os
import sys

# MLflow 3 keeps the file store behind this switch (it prefers a database backend); ferl writes the file store.
os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")

from mlflow.tracking import MlflowClient  # noqa: E402


def main():
    uri, name = sys.argv[1], sys.argv[2]
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(name)
    if exp is None:
        print(json.dumps({"experiment": None}))
        return
    runs = []
    for run in client.search_runs([exp.experiment_id]):
        info = run.info
        metrics = {}
        for key in run.data.metrics:
            history = client.get_metric_history(info.run_id, key)
            metrics[key] = sorted([m.step, m.value] for m in history)
        runs.append(
            {
                "run_id": info.run_id,
                "run_name": info.run_name,
                "status": info.status,
                "start_time": info.start_time,
                "end_time": info.end_time,
                "params": run.data.params,
                "tags": run.data.tags,
                "metrics": metrics,
            }
        )
    out = {
        "experiment": {
            "experiment_id": exp.experiment_id,
            "name": exp.name,
            "lifecycle_stage": exp.lifecycle_stage,
        },
        "runs": runs,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
