"""Keeps helm/moray/values.schema.json's `cluster` section equal to cluster.config.ClusterConfig.

The chart's `cluster:` values are exactly a ClusterConfig, so their JSON Schema is generated from the
pydantic model rather than written twice. The hand-written part of values.schema.json (everything else; its
definitions are named k8s*) is kept as is; every other entry of `definitions` is regenerated.

    .venv/bin/python helm/gen_values_schema.py           # rewrite values.schema.json
    .venv/bin/python helm/gen_values_schema.py --check   # exit 1 when it is stale (tests/test_helm.py)

Post-processing on top of pydantic's schema, so that `helm install` rejects what the Python model (or the
GKE rules the chart applies) would reject:
- titles and defaults are dropped (defaults such as compilation_cache_dir depend on the machine);
- TPUConfig.topology gets a pattern (positive integers joined by "x"), 2-D for v5e/v6e and 3-D for
  v4/v5p/v7x.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = ROOT / "helm" / "moray" / "values.schema.json"
HAND_WRITTEN_PREFIX = "k8s"

TOPOLOGY_2D = r"^[1-9][0-9]*x[1-9][0-9]*$"
TOPOLOGY_3D = r"^[1-9][0-9]*x[1-9][0-9]*x[1-9][0-9]*$"
PLANAR_TYPES = ["v5e", "v6e"]


def _strip(node: Any) -> Any:
    """Drop `title` and `default` from every schema node (not from property names)."""
    if isinstance(node, list):
        return [_strip(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("title", "default"):
            continue
        if key in ("properties", "$defs", "definitions", "patternProperties"):
            out[key] = {name: _strip(sub) for name, sub in value.items()}
        else:
            out[key] = _strip(value)
    return out


def cluster_definitions() -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from cluster.config import ClusterConfig

    schema = ClusterConfig.model_json_schema(ref_template="#/definitions/{model}", mode="validation")
    defs = schema.pop("$defs", {})
    defs["ClusterConfig"] = schema
    defs = {name: _strip(d) for name, d in defs.items()}

    tpu = defs["TPUConfig"]
    tpu["properties"]["topology"]["pattern"] = r"^[1-9][0-9]*x[1-9][0-9]*(x[1-9][0-9]*)?$"
    tpu["properties"]["topology"]["description"] = (
        "slice topology: AxB for v5e/v6e (e.g. 2x4, 4x4), AxBxC for v4/v5p/v7x (e.g. 2x2x1, 2x2x4)"
    )
    tpu["allOf"] = [
        {
            # type defaults to v6e, so a missing type counts as planar.
            "if": {"anyOf": [{"not": {"required": ["type"]}}, {"properties": {"type": {"enum": PLANAR_TYPES}}}]},
            "then": {"properties": {"topology": {"pattern": TOPOLOGY_2D}}},
            "else": {"properties": {"topology": {"pattern": TOPOLOGY_3D}}},
        }
    ]
    return dict(sorted(defs.items()))


def render(current: dict[str, Any]) -> dict[str, Any]:
    new = dict(current)
    defs = {k: v for k, v in current.get("definitions", {}).items() if k.startswith(HAND_WRITTEN_PREFIX)}
    defs.update(cluster_definitions())
    new["definitions"] = dict(sorted(defs.items()))
    new.setdefault("properties", {})["cluster"] = {
        "$ref": "#/definitions/ClusterConfig",
        "description": "cluster.config.ClusterConfig: the Serve application's args (generated schema)",
    }
    return new


def dumps(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if values.schema.json is stale")
    args = parser.parse_args(argv)
    current_text = SCHEMA_PATH.read_text()
    new_text = dumps(render(json.loads(current_text)))
    if args.check:
        if new_text != current_text:
            print(
                f"{SCHEMA_PATH.relative_to(ROOT)} is stale against cluster.config.ClusterConfig; "
                "run: .venv/bin/python helm/gen_values_schema.py",
                file=sys.stderr,
            )
            return 1
        return 0
    if new_text != current_text:
        SCHEMA_PATH.write_text(new_text)
        print(f"wrote {SCHEMA_PATH.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
