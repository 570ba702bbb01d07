"""The real MLflow client against `keel model serve`: create a model and
versions, set and read aliases, search versions, delete an alias.

Usage: python mlflow_client.py URL   (MLFLOW_TRACKING_TOKEN set by the caller)
Prints one JSON line with what it saw; exits non-zero on any failure.
"""

import json
import sys

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

url = sys.argv[1]
c = MlflowClient(tracking_uri=url, registry_uri=url)

m = c.create_registered_model("mlf-model", tags={"team": "infra"}, description="from mlflow")
assert m.name == "mlf-model", m

v1 = c.create_model_version("mlf-model", source="s3://bucket/runs/r1/model", run_id="r1", tags={"k": "v"})
v2 = c.create_model_version("mlf-model", source="s3://bucket/runs/r2/model", run_id="r2")
assert (v1.version, v2.version) == ("1", "2") or (v1.version, v2.version) == (1, 2), (v1.version, v2.version)

c.set_registered_model_alias("mlf-model", "champion", v1.version)
c.set_registered_model_alias("mlf-model", "champion", v2.version)
champ = c.get_model_version_by_alias("mlf-model", "champion")
assert str(champ.version) == "2", champ
assert champ.source == "s3://bucket/runs/r2/model", champ.source

got = c.get_registered_model("mlf-model")
aliases = dict(got.aliases)

found = c.search_model_versions("name='mlf-model'")
by_run = c.search_model_versions("run_id='r1'")
models = c.search_registered_models(filter_string="name LIKE 'mlf-m%'")

one = c.get_model_version("mlf-model", "1")

# order_by, MLflow's default order (newest first) and max_results bounds.
c.create_registered_model("mlf-other")
newest = c.search_model_versions("name='mlf-model'", order_by=["version_number DESC"], max_results=1)
ascending = c.search_model_versions("name='mlf-model'", order_by=["`version_number` ASC"])
default_order = c.search_model_versions("name='mlf-model'")
models_desc = c.search_registered_models(order_by=["name DESC"])
models_by_time = c.search_registered_models(order_by=["creation_timestamp DESC", "name ASC"])


def refused(f):
    try:
        f()
        return "accepted"
    except MlflowException as e:
        return e.error_code


# What may change, and what may not, after READY.
c.update_registered_model("mlf-model", description="updated")
updated_v1 = c.update_model_version("mlf-model", "1", description="v1 notes")
c.rename_registered_model("mlf-other", "mlf-other2")
renamed = c.get_registered_model("mlf-other2")


def refusal(f):
    try:
        f()
        return ["accepted", ""]
    except MlflowException as e:
        return [e.error_code, e.message]


changes = {
    "model_description": c.get_registered_model("mlf-model").description,
    "v1_description": c.get_model_version("mlf-model", "1").description,
    "v1_updated_description": updated_v1.description,
    "renamed": renamed.name,
    "rename_with_versions": refusal(lambda: c.rename_registered_model("mlf-model", "mlf-x")),
    "delete_version": refusal(lambda: c.delete_model_version("mlf-model", "1")),
    "transition": refusal(lambda: c.transition_model_version_stage("mlf-model", "1", "Production")),
    "lineage_tag": refusal(lambda: c.set_model_version_tag("mlf-model", "1", "keel.code_commit", "x")),
}

client_errors = {
    "slash_name": refused(lambda: c.create_registered_model("team/model")),
    "colon_name": refused(lambda: c.create_registered_model("a:b")),
    "too_large": refused(lambda: c.create_registered_model("big", description="x" * (2 << 20))),
    "missing_version": refused(lambda: c.get_model_version("mlf-model", "99")),
    "missing_model": refused(lambda: c.get_registered_model("nope")),
}

order_errors = {
    "unknown": refused(lambda: c.search_model_versions("name='mlf-model'", order_by=["size DESC"])),
    "direction": refused(lambda: c.search_model_versions("", order_by=["name SIDEWAYS"])),
    "duplicate": refused(lambda: c.search_registered_models(order_by=["name", "name DESC"])),
    "models_unknown": refused(lambda: c.search_registered_models(order_by=["version_number"])),
    "too_many": refused(lambda: c.search_model_versions("", max_results=200_001)),
    "too_many_models": refused(lambda: c.search_registered_models(max_results=1001)),
}

c.delete_registered_model_alias("mlf-model", "champion")
try:
    c.get_model_version_by_alias("mlf-model", "champion")
    deleted = False
except MlflowException as e:
    # MLflow's code for a missing alias.
    deleted = e.error_code == "INVALID_PARAMETER_VALUE"
# Deleting it again succeeds, as in MLflow.
c.delete_registered_model_alias("mlf-model", "champion")

try:
    c.create_registered_model("mlf-model")
    dup = "accepted"
except MlflowException as e:
    dup = e.error_code

print(json.dumps({
    "versions": sorted(str(v.version) for v in found),
    "by_run": [str(v.version) for v in by_run],
    "models": [m.name for m in models],
    "aliases": {k: str(v) for k, v in aliases.items()},
    "v1_tags": dict(one.tags),
    "v1_run": one.run_id,
    "alias_deleted": deleted,
    "duplicate": dup,
    "newest": [str(v.version) for v in newest],
    "ascending": [str(v.version) for v in ascending],
    "default_order": [str(v.version) for v in default_order],
    "models_desc": [m.name for m in models_desc],
    "models_by_time": [m.name for m in models_by_time],
    "order_errors": order_errors,
    "client_errors": client_errors,
    "changes": changes,
}))
