"""MkDocs hook: the configuration reference, generated from omni-core's schema.

``docs/configuration.md`` holds the prose; the part between its markers
``<!-- config-reference -->`` and ``<!-- /config-reference -->`` is replaced at build time
by what this hook derives from the ``msgspec.Struct`` classes that parse and validate
pipeline YAML (``omni_core/config.py``):

- a YAML file with every key at its default (and an example value for each required
  one), each key commented with the first sentence of its documentation; the hook
  validates that YAML with ``omni_core.config.parse_config``, so the example itself
  cannot go stale;
- a table per section (top level, ``mrs``, ``stages[]``, ...) giving each key's type,
  default and documentation: the attribute docstring under the field in the source.

It also publishes the JSON Schema of the same classes (with those descriptions) as
``configuration/pipeline.schema.json``, for editors that validate YAML.

Types, defaults and constraints are read from the classes themselves
(``msgspec.inspect``), and the docs from the source file next to them, so the page
cannot drift from the code. A field without a docstring is a warning, which fails the
strict build (``hatch run docs:build``).
"""

from __future__ import annotations

import ast
import json
import logging
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import yaml

ROOT = Path(__file__).resolve().parents[2]
CORE_SRC = ROOT / "packages" / "omni-core" / "src"
if str(CORE_SRC) not in sys.path:  # document the working tree, whatever else is installed
    sys.path.insert(0, str(CORE_SRC))

from omni_core import config as schema  # noqa: E402

log = logging.getLogger("mkdocs.hooks.config_reference")

PAGE = "configuration.md"
MARKER = "<!-- config-reference -->"
END_MARKER = "<!-- /config-reference -->"  # what lies between (a note for GitHub) is replaced
SCHEMA_FILE = "configuration/pipeline.schema.json"

ROOT_STRUCT = schema.PipelineConfig
# fields of the structs that are not YAML keys
HIDDEN = {("PipelineConfig", "source_file")}
# the example values shown for list keys (and so for the required keys of their items);
# the first item of each list is shown with every key, the others as given
LIST_EXAMPLES: dict[tuple[str, str], list[dict[str, Any]]] = {
    ("PipelineConfig", "stages"): [
        {"name": "source", "kind": "synthetic.source"},
        {"name": "sink", "kind": "synthetic.map"},
    ],
    ("PipelineConfig", "edges"): [
        {"from": "source", "to": "sink", "window": {"size": 8, "overlap": 2}}
    ],
}
COMMENT_COLUMN = 30
WIDTH = 100


# -- reading the schema ----------------------------------------------------------------


def _attribute_docs() -> dict[str, dict[str, str]]:
    """{class name: {field name: docstring}} from the string under each annotated field."""
    tree = ast.parse(Path(schema.__file__).read_text(encoding="utf-8"))
    out: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs: dict[str, str] = {}
        for field, after in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(field, ast.AnnAssign)
                and isinstance(field.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[field.target.id] = _one_line(after.value.value)
        out[node.name] = docs
    return out


def _one_line(doc: str) -> str:
    return " ".join(line.strip() for line in doc.strip().splitlines())


def _class_doc(cls: type) -> str:
    doc = cls.__dict__.get("__doc__")  # not inherited: msgspec.Struct has its own
    return _one_line(doc) if isinstance(doc, str) else ""


class Section:
    """One struct of the schema, with the YAML paths where it appears."""

    def __init__(self, info: mi.StructType, path: str) -> None:
        self.info = info
        self.cls = info.cls
        self.paths = [path]

    @property
    def anchor(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.paths[0].lower()).strip("-")
        return f"key-{slug or 'top-level'}"

    @property
    def title(self) -> str:
        return self.paths[0] or "top level"

    @property
    def heading(self) -> str:
        return f"`{self.paths[0]}`" if self.paths[0] else "Top level"

    def fields(self) -> list[mi.Field]:
        return [f for f in self.info.fields if (self.cls.__name__, f.name) not in HIDDEN]


def _sections() -> list[Section]:
    """Every struct reachable from the root, depth first in field order."""
    found: dict[type, Section] = {}
    order: list[Section] = []

    def visit(info: mi.StructType, path: str) -> None:
        if info.cls in found:
            found[info.cls].paths.append(path)
            return
        section = Section(info, path)
        found[info.cls] = section
        order.append(section)
        for f in section.fields():
            for sub, suffix in _structs_in(f.type):
                visit(sub, f"{path}.{f.encode_name}{suffix}".lstrip("."))

    visit(mi.type_info(ROOT_STRUCT), "")
    return order


def _structs_in(t: mi.Type, suffix: str = "") -> list[tuple[mi.StructType, str]]:
    if isinstance(t, mi.StructType):
        return [(t, suffix)]
    if isinstance(t, mi.UnionType):
        return [s for u in t.types for s in _structs_in(u, suffix)]
    if isinstance(t, mi.ListType):
        return _structs_in(t.item_type, suffix + "[]")
    if isinstance(t, mi.DictType):
        return _structs_in(t.value_type, suffix + ".*")
    return []


# -- rendering -------------------------------------------------------------------------


def _code(text: str) -> str:
    """reStructuredText literals (``x``) as Markdown code spans."""
    return re.sub(r"``(.+?)``", r"`\1`", text)


def _constraints(t: Any) -> str:
    signs = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))
    out = [f"{sign} {getattr(t, key)}" for key, sign in signs if getattr(t, key, None) is not None]
    return f" {', '.join(out)}" if out else ""


def _type(t: mi.Type, links: dict[type, Section]) -> str:
    if isinstance(t, mi.UnionType):
        parts = [_type(u, links) for u in t.types if not isinstance(u, mi.NoneType)]
        if any(isinstance(u, mi.NoneType) for u in t.types):
            parts.append("`null`")
        return " or ".join(parts)
    if isinstance(t, mi.BoolType):
        return "boolean"
    if isinstance(t, mi.IntType):
        return "integer" + _constraints(t)
    if isinstance(t, mi.FloatType):
        return "number" + _constraints(t)
    if isinstance(t, mi.StrType):
        text = "string"
        if t.pattern:
            text += f" matching `{t.pattern}`"
        return text
    if isinstance(t, mi.LiteralType):
        return " or ".join(f"`{json.dumps(v)}`" for v in t.values)
    if isinstance(t, mi.ListType):
        text = f"list of {_type(t.item_type, links)}"
        if t.min_length:
            text += f" (at least {t.min_length})"
        return text
    if isinstance(t, mi.DictType):
        return f"mapping of {_type(t.key_type, links)} to {_type(t.value_type, links)}"
    if isinstance(t, mi.StructType):
        section = links[t.cls]
        return f"[{section.title}](#{section.anchor})"
    if isinstance(t, mi.AnyType):
        return "any"
    return type(t).__name__.removesuffix("Type").lower()


def _default_value(f: mi.Field) -> Any:
    if f.default is not msgspec.NODEFAULT:
        return f.default
    if f.default_factory is not msgspec.NODEFAULT:
        return f.default_factory()
    return msgspec.NODEFAULT


def _yaml_scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=1000, sort_keys=False)
    return text.strip().removesuffix("...").strip()


def _default(f: mi.Field) -> str:
    if f.required:
        return "required"
    value = _default_value(f)
    if isinstance(value, msgspec.Struct):
        return "its keys' defaults"
    return f"`{_yaml_scalar(value)}`"


def _first_sentence(doc: str) -> str:
    m = re.match(r"(.+?)(?<!e\.g)\.(\s|$)", doc)
    return m.group(1) if m else doc


def _comment_lines(line: str, doc: str) -> list[str]:
    text = _code(_first_sentence(doc)).replace("`", "")
    if not text:
        return [line]
    pad = max(COMMENT_COLUMN, len(line) + 2)
    wrapped = textwrap.wrap(text, width=max(30, WIDTH - pad - 2))
    out = [f"{line:<{pad}}# {wrapped[0]}"]
    out += [f"{'':<{pad}}# {rest}" for rest in wrapped[1:]]
    return out


def _yaml_lines(
    info: mi.StructType, docs: dict[str, dict[str, str]], indent: str, given: dict[str, Any]
) -> list[str]:
    """Every key of ``info``: ``given`` values, else the defaults, nested structs expanded."""
    lines: list[str] = []
    cls = info.cls.__name__
    for f in info.fields:
        if (cls, f.name) in HIDDEN:
            continue
        doc = docs.get(cls, {}).get(f.name, "")
        key = f"{indent}{f.encode_name}:"
        examples = LIST_EXAMPLES.get((cls, f.name))
        structs = _structs_in(f.type)
        if f.encode_name in given:
            lines += _comment_lines(f"{key} {_yaml_scalar(given[f.encode_name])}", doc)
        elif examples is not None:
            lines += _comment_lines(key, doc)
            item = structs[0][0] if structs else None
            for i, example in enumerate(examples):
                if item is not None and i == 0:
                    body = _yaml_lines(item, docs, indent + "    ", example)
                    lines.append(f"{indent}  - {body[0].lstrip()}")
                    lines += body[1:]
                else:
                    lines.append(f"{indent}  - {_yaml_scalar(example)}")
        elif structs and not f.required and isinstance(_default_value(f), msgspec.Struct):
            lines += _comment_lines(key, doc)
            lines += _yaml_lines(structs[0][0], docs, indent + "  ", {})
        elif f.required:
            raise ValueError(
                f"{cls}.{f.name} is required and has no example: give it one in LIST_EXAMPLES "
                f"of {__file__}"
            )
        else:
            lines += _comment_lines(f"{key} {_yaml_scalar(_default_value(f))}", doc)
    return lines


def example_yaml(docs: dict[str, dict[str, str]]) -> str:
    text = "\n".join(_yaml_lines(mi.type_info(ROOT_STRUCT), docs, "", {})) + "\n"
    schema.parse_config(yaml.safe_load(text), "<the generated example>", check_kinds=False)
    return text


def tables(sections: list[Section], docs: dict[str, dict[str, str]]) -> str:
    links = {s.cls: s for s in sections}
    out: list[str] = []
    for s in sections:
        cls = s.cls.__name__
        out.append(f"### {s.heading} {{ #{s.anchor} }}\n")
        if len(s.paths) > 1:
            out.append("Also at " + ", ".join(f"`{p}`" for p in s.paths[1:]) + ".\n")
        doc = _class_doc(s.cls)
        if doc:
            out.append(_code(doc) + "\n")
        out.append("| key | type | default | |")
        out.append("|---|---|---|---|")
        for f in s.fields():
            doc = docs.get(cls, {}).get(f.name)
            if not doc:
                log.warning(
                    "configuration reference: %s.%s (YAML key %r) has no docstring in %s",
                    cls,
                    f.name,
                    f.encode_name,
                    schema.__file__,
                )
                doc = ""
            cells = [f"`{f.encode_name}`", _type(f.type, links), _default(f), _code(doc)]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
    return "\n".join(out)


def json_schema(docs: dict[str, dict[str, str]]) -> str:
    """The JSON Schema of the root struct, with each key's description."""
    doc = msgspec.json.schema(ROOT_STRUCT)
    for s in _sections():
        definition = doc.get("$defs", {}).get(s.cls.__name__)
        if definition is None:
            continue
        props = definition.get("properties", {})
        for f in s.info.fields:
            if (s.cls.__name__, f.name) in HIDDEN:
                props.pop(f.encode_name, None)
                continue
            text = docs.get(s.cls.__name__, {}).get(f.name)
            if text and f.encode_name in props:
                props[f.encode_name]["description"] = text.replace("``", "`")
        if s.cls is ROOT_STRUCT:
            definition["patternProperties"] = {"^x-": {}}  # free keys for YAML anchors
    return json.dumps(doc, indent=2) + "\n"


def render() -> str:
    docs = _attribute_docs()
    sections = _sections()
    return "```yaml\n" + example_yaml(docs) + "```\n\n" + "## Keys\n\n" + tables(sections, docs)


# -- MkDocs hook events ----------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, SCHEMA_FILE, content=json_schema(_attribute_docs())))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    start, end = markdown.find(MARKER), markdown.find(END_MARKER)
    if start < 0 or end < start:
        log.warning("configuration reference: %s lacks %s ... %s", PAGE, MARKER, END_MARKER)
        return markdown
    try:
        generated = render()
    except Exception as e:  # a schema the generator cannot document: fail the build
        from mkdocs.exceptions import PluginError

        raise PluginError(f"configuration reference: {type(e).__name__}: {e}") from e
    return markdown[:start] + generated + markdown[end + len(END_MARKER) :]


if __name__ == "__main__":  # print the generated reference
    print(render())
