"""MLflow 3's `log_model(registered_model_name=...)` with a real MLflow
tracking server and `keel model serve` as the registry.

Usage (MLFLOW_TRACKING_URI: the MLflow server; MLFLOW_REGISTRY_URI: keel;
MLFLOW_TRACKING_TOKEN: a keel key):
  python mlflow_log_model.py log NAME
      start a run, log a tiny Python-function model (y = x + 1; no weights)
      in it, registered as NAME
  python mlflow_log_model.py register NAME MODEL_ID
      create a version of NAME from logged model MODEL_ID (source
      models:/MODEL_ID, model_id, no run_id), as log_model does
Prints one JSON line with what it saw; exits non-zero on any failure.
"""

import json
import sys

import mlflow
import mlflow.pyfunc
from mlflow import MlflowClient


class AddOne(mlflow.pyfunc.PythonModel):
    def predict(self, context, model_input, params=None):
        return model_input["x"] + 1


def version(name, number):
    v = MlflowClient().get_model_version(name, number)
    return {
        "version": str(v.version),
        "version_run_id": v.run_id or "",
        "version_source": v.source,
    }


def log(name):
    with mlflow.start_run() as run:
        # No requirement inference: it would import and time every package.
        info = mlflow.pyfunc.log_model(
            name="model",
            python_model=AddOne(),
            pip_requirements=[],
            registered_model_name=name,
        )
    out = {"run_id": run.info.run_id, "model_id": info.model_id}
    out.update(version(name, info.registered_model_version))
    # What the tracking server itself records as the model's run.
    out["logged_model_run_id"] = MlflowClient().get_logged_model(info.model_id).source_run_id
    print(json.dumps(out))


def register(name, model_id):
    v = MlflowClient().create_model_version(name, source=f"models:/{model_id}", model_id=model_id)
    print(json.dumps(version(name, v.version)))


if __name__ == "__main__":
    if sys.argv[1] == "log":
        log(sys.argv[2])
    else:
        register(sys.argv[2], sys.argv[3])
