"""Class fields (msgspec Structs, dataclasses) name their types unquoted inside generics.

Under ``from __future__ import annotations`` a field annotated ``list["X"]`` reaches msgspec and typing as
``list['X']``: Python 3.11's typing resolves the quoted name inside a builtin generic, 3.10's does not, and
msgspec then refuses the string (``TypeError: Type ''X'' is not supported``: no engine starts on 3.10). CI runs
3.11, so this test reads the source instead of resolving the types.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE_FOLDERS = ("asyncllm", "workers", "kernels", "integrations")


def _quoted_names(annotation: ast.expr) -> list[str]:
    """The string constants of an annotation expression, those of ``Literal[...]`` left out."""
    if isinstance(annotation, ast.Constant):
        return []  # a whole-string annotation: typing evaluates it as one expression, on 3.10 too
    return _strings(annotation)


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Subscript) and _is_literal(node.value):
        return []  # the literal's values are values, not type names
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    return [name for child in ast.iter_child_nodes(node) for name in _strings(child)]


def _is_literal(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "Literal") or (
        isinstance(node, ast.Attribute) and node.attr == "Literal")


def quoted_field_annotations(source: str, filename: str) -> list[str]:
    problems = []
    for cls in ast.walk(ast.parse(source, filename)):
        if not isinstance(cls, ast.ClassDef):
            continue
        for field in cls.body:
            if isinstance(field, ast.AnnAssign) and (names := _quoted_names(field.annotation)):
                problems.append(f"{filename}:{field.lineno}: {cls.name}: {ast.unparse(field.annotation)} {names}")
    return problems


def test_the_check_finds_a_quoted_name_in_a_generic() -> None:
    source = (
        "class A:\n"
        "    items: list['Item'] = []\n"
        "    other: dict[str, 'Item | None']\n"
        "    fine: list[Item]\n"
        "    whole: 'Item | None' = None\n"
        "    mode: Literal['a', 'b'] | None = None\n"
    )
    assert [p.split(": ", 1)[0] for p in quoted_field_annotations(source, "m.py")] == ["m.py:2", "m.py:3"]


def test_no_field_quotes_a_name_inside_a_generic() -> None:
    problems = []
    for folder in PACKAGE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            problems += quoted_field_annotations(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not problems, "unquote these (Python 3.10's typing and msgspec cannot resolve them):\n" + "\n".join(problems)
