"""The real MLflow client loading models from `keel model serve`.

Usage:
  python mlflow_load.py save DIR
      write a tiny Python-function model (y = x + 1; no weights) to DIR
  python mlflow_load.py load DIR MODEL [STORE_MODEL:VERSION ...]
      with MLFLOW_TRACKING_URI pointing at keel: load MODEL through every
      kind of models:/ URI, register DIR through the client and load it by
      alias, download every version with mlflow.artifacts, and for each
      STORE_MODEL:VERSION (versions keel registered into Azurite or S3)
      download and load it with the client's own storage credentials.
Prints one JSON line with what it saw; exits non-zero on any failure.
"""

import filecmp
import json
import os
import sys
import tempfile

import mlflow
import mlflow.pyfunc
import pandas as pd
from mlflow import MlflowClient


class AddOne(mlflow.pyfunc.PythonModel):
    def predict(self, context, model_input, params=None):
        return model_input["x"] + 1


def save(path):
    # No requirement inference: it would import and time every package.
    mlflow.pyfunc.save_model(path, python_model=AddOne(), pip_requirements=[])


def predict(uri):
    m = mlflow.pyfunc.load_model(uri)
    return [int(v) for v in m.predict(pd.DataFrame({"x": [1, 41]}))]


def same_tree(a, b):
    """Every file of `a` is in `b` with the same bytes (b may hold more):
    True, or the names that differ. `registered_model_meta` is what the
    client itself writes into a model directory it loaded by models:/ URI."""
    bad = []
    for root, _, files in os.walk(a):
        for f in files:
            if f == "registered_model_meta":
                continue
            rel = os.path.relpath(os.path.join(root, f), a)
            other = os.path.join(b, rel)
            if not os.path.isfile(other) or not filecmp.cmp(os.path.join(a, rel), other, shallow=False):
                bad.append(rel)
    return True if not bad else sorted(bad)


def load(model_dir, name, stored):
    c = MlflowClient()
    out = {}
    out["alias"] = predict(f"models:/{name}@production")
    out["number"] = predict(f"models:/{name}/1")
    out["latest"] = predict(f"models:/{name}/latest")
    v1 = c.get_model_version(name, "1")
    out["v1_source"] = v1.source
    out["v1_run_id"] = v1.run_id
    out["v1_tags"] = dict(v1.tags)
    out["download_uri"] = c.get_model_version_download_uri(name, "1")
    out["latest_versions"] = [v.version for v in c.get_latest_versions(name)]
    with tempfile.TemporaryDirectory() as d:
        got = mlflow.artifacts.download_artifacts(f"models:/{name}/1", dst_path=d)
        out["download_same"] = same_tree(model_dir, got)

    # Registered through the client, from a file:// source; loaded by alias.
    v = c.create_model_version(name, source=f"file://{model_dir}", run_id="run-from-client")
    c.set_registered_model_alias(name, "champion", v.version)
    out["client_version"] = str(v.version)
    out["client_alias"] = predict(f"models:/{name}@champion")
    out["client_run_id"] = c.get_model_version(name, v.version).run_id
    # The fluent API, as an MLflow user registers a model directory.
    fluent = mlflow.register_model(f"file://{model_dir}", name)
    out["fluent_version"] = str(fluent.version)
    out["fluent"] = predict(f"models:/{name}/{fluent.version}")

    out["stored"] = {}
    for ref in stored:
        sname, sver = ref.rsplit(":", 1)
        with tempfile.TemporaryDirectory() as d:
            got = mlflow.artifacts.download_artifacts(f"models:/{sname}/{sver}", dst_path=d)
            same = same_tree(model_dir, got)
        out["stored"][ref] = {
            "source": c.get_model_version(sname, sver).source,
            "download_same": same,
            "predict": predict(f"models:/{sname}/{sver}"),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save(sys.argv[2])
    else:
        load(sys.argv[2], sys.argv[3], sys.argv[4:])
