"""JSON schemas as applications send them, made enforceable without letting through anything invalid.

llguidance compiles most of JSON Schema, but not `not`, `if`/`then`/`else`, `dependencies`
(`dependentRequired`, `dependentSchemas`), `uniqueItems`, `propertyNames`, unknown `format`s, overlapping
`patternProperties` or `oneOf` branches it cannot prove disjoint; about one real-world schema in seven
uses one of them. `enforceable(schema)` rewrites those into what the grammar engine can enforce, only
where every output the rewrite allows still validates against the schema as sent (sound); what it cannot
rewrite soundly is left for the engine to refuse, by keyword:

- `format` the engine does not know: dropped (in JSON Schema a format is an annotation);
- `if`/`then`/`else`: the instance satisfies `if` and `then` (or `else` alone when there is no `then`);
- `dependencies` / `dependentRequired` / `dependentSchemas` on property p: p required -> its dependents
  are required too (or its schema applies); p optional -> p is left out;
- `uniqueItems`: arrays of at most one item (every such array is unique);
- `propertyNames`: only the listed properties whose names satisfy it, nothing else;
- `patternProperties` that may overlap: only the listed properties, each also satisfying the patterns
  its name matches;
- `not: {"required": [p]}`, `not: {"anyOf": [{"required": [p]}, ...]}`: an object without those properties;
  other `not`s are refused.

- what is still out of reach (`not` of a pattern, `contains`, `unevaluatedProperties`, ...) is pruned
  where the schema lets it go: an optional property whose schema uses it is left out, an `anyOf` branch
  dropped, an array's items forbidden when it may be empty, a pattern or additional property forbidden
  (only where it is required, or the whole document, is the schema refused).

Each rewrite narrows what the model may write, never widens it. `oneOf` becomes `anyOf` only where no
instance can match two branches (disjoint types; objects told apart by a property one branch requires and
another forbids, or by a required property's disjoint `const`/`enum` values); elsewhere it stays `oneOf`
(the engine refuses branches it cannot prove disjoint): treating it as `anyOf` would let through outputs
valid for two branches, which the schema forbids.
"""

from __future__ import annotations

import copy
import json
from typing import Any

# The formats llguidance knows (others fail to compile).
KNOWN_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"})

# Keywords whose value is one schema, a list of schemas, or a map of name -> schema.
_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames", "additionalItems")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def enforceable(schema: Any, prune_one_of: bool = False) -> Any:
    """A copy of `schema` with the sound rewrites above applied to every subschema. `prune_one_of`: also
    prune, like what is out of reach, every `oneOf` not proved disjoint here (for when the grammar engine
    cannot prove it either)."""
    out = copy.deepcopy(_without_unused_defs(schema))
    _walk(out)
    _walk_one_ofs(out, out)
    _Pruner(out, prune_one_of).fix(out)
    return out


_DEFS = ("$defs", "definitions")


def _without_unused_defs(schema: Any) -> Any:
    """`schema` without the root definitions no reference reaches (a shallow copy; the schema itself when
    all are used or a reference cannot be followed here). Schemas often carry a whole library of
    definitions (a Kubernetes kind inlines all ~860 for the few it uses): rewriting and compiling only
    what is reachable keeps a request's host work proportional to its schema, not to the library."""
    if not isinstance(schema, dict) or not any(isinstance(schema.get(k), dict) for k in _DEFS):
        return schema
    used: dict[str, set[str]] = {k: set() for k in _DEFS}
    top = {k: v for k, v in schema.items() if k not in _DEFS and k != "$id"}  # the root's own $id is the base
    pending: list = [top]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        named = {"$dynamicRef", "$recursiveRef", "$anchor", "$id"} & set(node) or isinstance(node.get("id"), str)  # draft 4: id
        if named and node is not top:
            return schema  # references by name or another base URI: not followed here, so nothing is left out
        ref = node.get("$ref")
        if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
            return schema
        parts = ref.split("/") if isinstance(ref, str) else []
        if len(parts) >= 2 and parts[1] not in _DEFS and parts[1] not in top:
            return schema  # a pointer spelled another way (percent-encoded, ...): not followed here
        if len(parts) >= 3 and parts[1] in _DEFS:
            name = parts[2].replace("~1", "/").replace("~0", "~")
            target = (schema.get(parts[1]) or {}).get(name) if isinstance(schema.get(parts[1]), dict) else None
            if target is None:
                return schema  # a reference it cannot resolve: the compiler reports it, on the whole schema
            if name not in used[parts[1]]:
                used[parts[1]].add(name)
                pending.append(target)
        pending.extend(v for k, v in node.items() if k != "$ref")
    out = dict(schema)
    for key in _DEFS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: sub for name, sub in schema[key].items() if name in used[key]}
    return out


def _walk(node: Any) -> None:
    if not isinstance(node, dict):
        return
    _rewrite(node)
    for key in _ONE:
        if key in node:
            value = node[key]
            for item in value if isinstance(value, list) else [value]:  # draft-4 `items` may be a list
                _walk(item)
    for key in _LIST:
        for item in node.get(key) or []:
            _walk(item)
    for key in _MAP:
        value = node.get(key)
        if isinstance(value, dict):
            for item in value.values():
                _walk(item)


def _rewrite(s: dict) -> None:
    fmt = s.get("format")
    if isinstance(fmt, str) and fmt not in KNOWN_FORMATS:
        del s["format"]
    if "if" in s or "then" in s or "else" in s:
        cond, then, other = s.pop("if", None), s.pop("then", None), s.pop("else", None)
        if cond is not None:
            if then is not None:
                _all_of(s, cond, then)
            elif other is not None:
                _all_of(s, other)
    _dependencies(s)
    if s.get("uniqueItems") is True and s.get("minItems", 0) <= 1:  # else left for the engine to refuse
        del s["uniqueItems"]
        s["maxItems"] = min(s.get("maxItems", 1), 1)
    elif s.get("uniqueItems") is False:
        del s["uniqueItems"]
    if "propertyNames" in s:
        _property_names(s, s.pop("propertyNames"))
    if isinstance(s.get("patternProperties"), dict) and len(s["patternProperties"]) > 1:
        _only_listed_properties(s)
    if isinstance(s.get("not"), dict):
        _not(s)
    if isinstance(s.get("oneOf"), list):
        _one_of_types(s["oneOf"])


_TYPES = ("string", "number", "integer", "object", "array", "boolean", "null")
# Keywords that constrain instances of one type only (the others pass them untouched).
_BY_TYPE = {
    "string": {"minLength", "maxLength", "pattern", "format", "contentEncoding", "contentMediaType"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "object": {
        "properties",
        "patternProperties",
        "additionalProperties",
        "required",
        "minProperties",
        "maxProperties",
        "propertyNames",
        "dependencies",
        "dependentRequired",
        "dependentSchemas",
        "unevaluatedProperties",
    },
    "array": {"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains", "unevaluatedItems"},
}
_BY_TYPE["integer"] = _BY_TYPE["number"]
# Keywords that say nothing about which instances are valid.
_ANNOTATIONS = {
    "title",
    "description",
    "default",
    "examples",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "markdownDescription",
    "$id",
    "$schema",
    "$anchor",
    "x-intellij-html-description",
    "errorMessage",
}


def _not(s: dict) -> None:
    """The `not`s that have an exact positive form: not {} (nothing), not {type: T} (the other types),
    not {required: [p]} and not {anyOf: [{required: [p]}, ...]} (an object without those properties; properties
    whose schema is `true` say nothing there); other forms stay for the engine to refuse."""
    neg = _constraints(s["not"])
    absent = _absent_properties(neg)
    if not neg:
        del s["not"]
        s["enum"] = []  # `{}` accepts everything, so its negation nothing
    elif set(neg) == {"type"}:
        banned = {neg["type"]} if isinstance(neg["type"], str) else set(neg["type"])
        if "number" in banned:
            banned.add("integer")
        del s["not"]
        s["type"] = [t for t in _allowed_types(s) if t not in banned]
    elif absent is not None:
        # `required` passes every non-object, so its negation accepts objects only.
        del s["not"]
        s["type"] = ["object"] if "object" in _allowed_types(s) else []
        for name in absent:
            _leave_out(s, name, "not")


def _constraints(schema: Any) -> Any:
    """A schema without its annotations, and without `properties` entries that accept anything (`true`, `{}`:
    they constrain nothing), for recognising the forms of a `not`."""
    if not isinstance(schema, dict):
        return schema
    out = {k: v for k, v in schema.items() if k not in _ANNOTATIONS}
    if isinstance(out.get("properties"), dict):
        props = {k: v for k, v in out["properties"].items() if v is not True and v != {}}
        if props:
            out["properties"] = props
        else:
            del out["properties"]
    return out


def _absent_properties(neg: Any) -> list[str] | None:
    """The properties whose presence a `not` forbids when it is {required: [p]} or {anyOf: [{required: [p]}, ...]}
    (each with one name); None for any other form."""
    if not isinstance(neg, dict):
        return None
    branches = [neg] if set(neg) == {"required"} else neg.get("anyOf") if set(neg) == {"anyOf"} else None
    if not isinstance(branches, list) or not branches:
        return None
    names = []
    for branch in map(_constraints, branches):
        if not isinstance(branch, dict) or set(branch) != {"required"} or not isinstance(branch["required"], list):
            return None
        if len(branch["required"]) != 1 or not isinstance(branch["required"][0], str):
            return None
        names.append(branch["required"][0])
    return names


def _allowed_types(s: dict) -> list[str]:
    allowed = s.get("type", list(_TYPES))
    return [allowed] if isinstance(allowed, str) else list(allowed)


def _types_unconstrained(branch: dict) -> set[str] | None:
    """The types whose every instance `branch` accepts (None when it is more than a type test)."""
    if not isinstance(branch, dict) or "type" not in branch:
        return None
    types = {branch["type"]} if isinstance(branch["type"], str) else set(branch["type"])
    rest = set(branch) - {"type"} - _ANNOTATIONS
    if rest - set().union(*(_BY_TYPE.get(t, set()) for t in _TYPES)):
        return None  # enum, const, allOf, $ref, ...: applies to every type
    return {t for t in types if not (rest & _BY_TYPE.get(t, set()))}


def _one_of_types(branches: list) -> None:
    """A type that two or more branches accept whole (e.g. null in ["string", "null"] and ["integer",
    "null"], Kubernetes' int-or-string) makes every instance of it match several branches: oneOf refuses
    them all, so those branches drop the type. What remains is the same oneOf, with disjoint types."""
    whole = [_types_unconstrained(b) for b in branches]
    for t in _TYPES:
        holders = [i for i, w in enumerate(whole) if w is not None and t in w]
        if len(holders) < 2:
            continue
        for i in holders:
            b = branches[i]
            types = [b["type"]] if isinstance(b["type"], str) else list(b["type"])
            b["type"] = [x for x in types if x != t]


def _all_of(s: dict, *schemas: Any) -> None:
    s["allOf"] = list(s.get("allOf") or []) + [x for x in schemas if x is not None]


class Unenforceable(ValueError):
    """A keyword no sound rewrite can make enforceable here (the request is refused, naming it)."""

    def __init__(self, keyword: str, why: str):
        super().__init__(f"{keyword}: {why}")
        self.keyword = keyword


def _leave_out(s: dict, name: str, keyword: str = "") -> None:
    """Property `name` never appears (a false schema for it)."""
    if name in (s.get("required") or []):
        raise Unenforceable(keyword, f"leaving out {name!r} would break the schema (it is required)")
    s.setdefault("properties", {})[name] = False


def _dependencies(s: dict) -> None:
    deps: dict[str, Any] = {}
    for key in ("dependencies", "dependentRequired", "dependentSchemas"):
        value = s.pop(key, None)
        if isinstance(value, dict):
            deps.update(value)
    required = set(s.get("required") or [])
    for name, dep in deps.items():
        if name not in required:
            _leave_out(s, name, "dependencies")
        elif isinstance(dep, list):
            s["required"] = list(s.get("required") or []) + [d for d in dep if d not in required]
            required |= set(dep)
        else:
            _all_of(s, dep)


def _names(s: dict) -> list[str]:
    return list((s.get("properties") or {}).keys())


def _property_names(s: dict, rule: Any) -> None:
    """Only the listed properties whose names satisfy `rule`; nothing else."""
    import jsonschema

    for name in _names(s):
        if s["properties"][name] is not False and not jsonschema.Draft202012Validator(rule).is_valid(name):
            _leave_out(s, name, "propertyNames")
    s["additionalProperties"] = False
    s.pop("patternProperties", None)


def _only_listed_properties(s: dict) -> None:
    """Overlapping patternProperties: only the listed properties, each also satisfying every pattern
    its name matches (what the schema asks of it), and nothing else."""
    import re

    patterns = s.pop("patternProperties")
    for name in _names(s):
        matched = [sub for pattern, sub in patterns.items() if _search(re, pattern, name)]
        if matched and s["properties"][name] is not False:
            s["properties"][name] = {"allOf": [s["properties"][name], *matched]}
    s["additionalProperties"] = False


def _search(re, pattern: str, name: str) -> bool:
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return True  # a pattern Python cannot read: assume it applies (narrower, never wider)


# The grammar engine's refusals, by the keyword they name.
_ENGINE_ERRORS = (
    ("oneOf constraints are not supported", "oneOf"),
    ("patternProperty regexes", "patternProperties"),
    ("look-around", "pattern"),
    ("regex parse error", "pattern"),
    ("Unknown format", "format"),
)


def refused_keyword(error: str) -> str | None:
    """The JSON Schema keyword a grammar-engine error is about (None when it names none)."""
    import re

    m = re.search(r"Unimplemented keys: \[([^\]]*)\]", error)
    if m:
        return ", ".join(k.strip().strip('"') for k in m.group(1).split(","))
    return next((kw for text, kw in _ENGINE_ERRORS if text in error), None)


# ---------------------------------------------------------------- oneOf whose branches cannot overlap


def _walk_one_ofs(node: Any, root: Any) -> None:
    """Every `oneOf` whose branches no instance can match two of becomes `anyOf` (the two then mean the same):
    branches of disjoint JSON types, or objects told apart by a property one requires and another forbids, or
    that both require with disjoint `const`/`enum` values (a discriminator). llguidance proves this itself only
    for plain types, not through `$ref`s, enums, allOf or properties."""
    if isinstance(node, dict):
        branches = node.get("oneOf")
        if isinstance(branches, list) and branches and _pairwise_disjoint([_Shape.of(b, root) for b in branches]):
            node["anyOf"] = node.pop("oneOf") if "anyOf" not in node else node["anyOf"]
        for value in node.values():
            _walk_one_ofs(value, root)
    elif isinstance(node, list):
        for value in node:
            _walk_one_ofs(value, root)


_ALL = frozenset(_TYPES)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


def _possible_types(node: Any, root: Any, depth: int) -> frozenset[str]:
    """The JSON types of the instances `node` may accept (an over-approximation: never too few)."""
    if node is False:
        return frozenset()
    if not isinstance(node, dict) or depth > 32:
        return _ALL
    out = _ALL
    if "type" in node:
        types = {node["type"]} if isinstance(node["type"], str) else set(node["type"])
        if "number" in types:
            types.add("integer")
        out = out & frozenset(types)
    for key in ("enum", "const"):
        if key in node:
            values = node[key] if key == "enum" and isinstance(node[key], list) else [node[key]]
            out = out & frozenset(_json_type(v) for v in values)
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = _resolve(root, ref)
        out = out & (_possible_types(target, root, depth + 1) if target is not None else _ALL)
    for part in node.get("allOf") or []:
        out = out & _possible_types(part, root, depth + 1)
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            out = out & frozenset().union(*(_possible_types(b, root, depth + 1) for b in node[key]))
    return out


def _resolve(root: Any, ref: str) -> Any:
    """A local `#/...` reference's target in `root` (None for anything else)."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


class _Shape:
    """What every instance a schema accepts is known to satisfy (facts that hold; never more): its possible
    JSON types and, for objects, the properties it requires, those it forbids and the values it allows for a
    property (`const`/`enum`)."""

    def __init__(self, types: frozenset[str]):
        self.types = types
        self.required: set[str] = set()
        self.forbidden: set[str] = set()
        self.values: dict[str, set[str]] = {}  # property -> its allowed values (JSON-encoded)
        # A part with `additionalProperties: false` forbids what it does not list; the names listed by any part
        # are kept out of that (fewer facts, never a wrong one).
        self.closed = False
        self.listed: set[str] = set()

    @classmethod
    def of(cls, node: Any, root: Any) -> _Shape:
        shape = cls(_possible_types(node, root, 0))
        shape._add_object_facts(node, root, 0)
        return shape

    def _add_object_facts(self, node: Any, root: Any, depth: int) -> None:
        """From the node, its `$ref` and its `allOf` parts (each holds of every instance)."""
        if not isinstance(node, dict) or depth > 32:
            return
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        self.required |= {p for p in node.get("required") or [] if isinstance(p, str)}
        self.forbidden |= {p for p, sub in props.items() if sub is False}
        self.listed |= set(props)
        if node.get("additionalProperties") is False and not node.get("patternProperties"):
            self.closed = True
        for p, sub in props.items():
            values = _allowed_values(sub, root)
            if values is not None:
                self.values[p] = values if p not in self.values else self.values[p] & values
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            self._add_object_facts(_resolve(root, ref), root, depth + 1)
        for part in node.get("allOf") or []:
            self._add_object_facts(part, root, depth + 1)

    def forbids(self, name: str) -> bool:
        return name in self.forbidden or (self.closed and name not in self.listed)

    def disjoint_objects(self, other: _Shape) -> bool:
        """No object satisfies both."""
        if any(other.forbids(p) for p in self.required) or any(self.forbids(p) for p in other.required):
            return True
        both = self.required & other.required
        return any(p in self.values and p in other.values and not self.values[p] & other.values[p] for p in both)


def _allowed_values(node: Any, root: Any, depth: int = 0) -> set[str] | None:
    """The values a schema allows when it lists them (`const`, `enum`, through a `$ref`), JSON-encoded; None
    when it does not."""
    if not isinstance(node, dict) or depth > 32:
        return None
    if "const" in node:
        return {json.dumps(_same_number(node["const"]), sort_keys=True)}
    if isinstance(node.get("enum"), list):
        return {json.dumps(_same_number(v), sort_keys=True) for v in node["enum"]}
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        return _allowed_values(_resolve(root, ref), root, depth + 1)
    return None


def _same_number(value: Any) -> Any:
    """The value with integral floats as integers, everywhere in it: JSON Schema compares 1.0 equal to 1."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_same_number(v) for v in value]
    if isinstance(value, dict):
        return {k: _same_number(v) for k, v in value.items()}
    return value


def _pairwise_disjoint(shapes: list[_Shape]) -> bool:
    for i, a in enumerate(shapes):
        for b in shapes[i + 1 :]:
            common = a.types & b.types
            if common - {"object"} or ("object" in common and not a.disjoint_objects(b)):
                return False
    return True


# ---------------------------------------------------------------- pruning what stays out of reach

# What llguidance refuses once the rewrites above are done.
_OUT_OF_REACH = frozenset(
    {
        "not",
        "contains",
        "unevaluatedProperties",
        "unevaluatedItems",
        "if",
        "then",
        "else",
        "dependencies",
        "dependentRequired",
        "dependentSchemas",
        "uniqueItems",
        "propertyNames",
    }
)


class _Pruner:
    """Leaves out of the schema the parts that use keywords out of reach, where the schema allows it (the
    module docstring); `fix(node)` is False when `node` itself must go (its parent decides)."""

    def __init__(self, root: Any, prune_one_of: bool = False):
        self.root = root
        self.prune_one_of = prune_one_of
        self.refs: dict[str, bool] = {}

    def fix(self, node: Any) -> bool:
        if not isinstance(node, dict):
            return True
        if _OUT_OF_REACH & set(node) or (self.prune_one_of and "oneOf" in node):
            return False
        ok = self._properties(node) and self._items(node) and self._branches(node) and self._ref(node)
        for key in ("$defs", "definitions"):
            for sub in (node.get(key) or {}).values():
                self.fix(sub)  # pruned inside where possible; a $ref to one that must go decides at the $ref
        return ok

    def _properties(self, node: dict) -> bool:
        required = set(node.get("required") or [])
        for name, sub in list((node.get("properties") or {}).items()):
            if not self.fix(sub):
                if name in required:
                    return False
                node["properties"][name] = False
        for pattern, sub in list((node.get("patternProperties") or {}).items()):
            if not self.fix(sub):
                node["patternProperties"][pattern] = False
        if isinstance(node.get("additionalProperties"), dict) and not self.fix(node["additionalProperties"]):
            node["additionalProperties"] = False
        return True

    def _items(self, node: dict) -> bool:
        items = node.get("items")
        if isinstance(items, dict) and not self.fix(items):
            if node.get("minItems", 0) > 0:
                return False
            node["maxItems"] = 0
        elif isinstance(items, list) and not all(self.fix(i) for i in items):
            return False
        return all(self.fix(i) for i in node.get("prefixItems") or [])

    def _branches(self, node: dict) -> bool:
        if isinstance(node.get("anyOf"), list):
            kept = [b for b in node["anyOf"] if self.fix(b)]
            if not kept:
                return False
            node["anyOf"] = kept
        return all(self.fix(b) for key in ("allOf", "oneOf") for b in node.get(key) or [])

    def _ref(self, node: dict) -> bool:
        ref = node.get("$ref")
        if not isinstance(ref, str) or not ref.startswith("#"):
            return True
        if ref not in self.refs:
            self.refs[ref] = True  # a recursive schema: assume fine while in progress
            target = _resolve(self.root, ref)
            self.refs[ref] = target is None or self.fix(target)
        return self.refs[ref]
