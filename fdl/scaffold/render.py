"""What ``fdl init`` writes: the project name, the template, and every file's text.

Pure apart from reading the templates (package data under ``templates/``). A template file is
plain text with three kinds of marks, nothing more:

* ``{{key}}`` is replaced by a value (``name``, ``epochs``, ``torch_version``, ``fdl_wheel``,
  ...);
* ``{{#key}}`` ... ``{{/key}}`` keeps what is between them only when ``key`` is true (the
  Docker parts of the Makefile and README, dropped with ``--no-docker``); marks on lines of their
  own drop their lines too;
* ``{{>gpt/model.py}}``, on a line of its own, is the text of ``templates/gpt/model.py.tmpl``
  (read before the other marks are filled): a piece two templates share, written once (the
  ``loop`` template trains the ``gpt`` template's model on its corpus with its own loop).

A mark with no value is a bug in fdl, caught by the tests that render every template.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources

from fdl.errors import UsageError
from fdl.scaffold.docker import TorchImage


@dataclass(frozen=True)
class Template:
    """One kind of project; ``epochs`` and ``batch_size`` go into both train.py and fdl.toml,
    ``training`` (how train.py trains) into the README."""

    summary: str
    epochs: int
    batch_size: int
    training: str = "`fdl.Trainer(...).fit()`"


TEMPLATES: dict[str, Template] = {
    "mlp": Template("an MLP classifier on synthetic clusters", epochs=5, batch_size=64),
    "cnn": Template("a small conv net on synthetic 28x28 images", epochs=3, batch_size=32),
    "gpt": Template("a character-level GPT on a short built-in text", epochs=3, batch_size=32),
    # train.py's MAX_STEPS ends the run; epochs is a bound large enough not to end it first
    "loop": Template("a character-level GPT trained by its own loop, in nanoGPT's shape",
                     epochs=10, batch_size=16,
                     training="its own training loop on `fdl.init()` and `run.batches(...)`"),
}

# Output path -> template file; "{template}" is the chosen template's folder.
PROJECT_FILES = {
    "train.py": "{template}/train.py.tmpl",
    "tests/test_train.py": "common/test_train.py.tmpl",
    "fdl.toml": "common/fdl.toml.tmpl",
    "pyproject.toml": "common/pyproject.toml.tmpl",
    "README.md": "common/README.md.tmpl",
    "Makefile": "common/Makefile.tmpl",
    ".gitignore": "common/gitignore.tmpl",
}
DOCKER_FILES = {
    "Dockerfile": "common/Dockerfile.tmpl",
    ".dockerignore": "common/dockerignore.tmpl",
}

# Letters, digits, "-" and "_", starting with a letter: a valid distribution and directory name.
_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
# The project depends on these; a project with the same name would shadow them.
_TAKEN_NAMES = frozenset({"fdl", "torch", "numpy", "pytest"})
# A section on lines of its own drops those lines too; an inline one only its text.
_BLOCK_RE = re.compile(r"^\{\{#(\w+)\}\}\n(.*?)^\{\{/\1\}\}\n", re.DOTALL | re.MULTILINE)
_INLINE_RE = re.compile(r"\{\{#(\w+)\}\}(.*?)\{\{/\1\}\}", re.DOTALL)
_VALUE_RE = re.compile(r"\{\{(\w+)\}\}")
_PARTIAL_RE = re.compile(r"^\{\{>([\w/.]+)\}\}\n", re.MULTILINE)


def validate_name(name: str) -> str:
    """``name`` if it can name the project (directory, pyproject, Docker image); else UsageError."""
    if not _NAME_RE.fullmatch(name):
        raise UsageError(
            f"invalid project name {name!r}: use letters, digits, '-' and '_', "
            "starting with a letter",
            hint="e.g. fdl init my-model  (a path works too: fdl init ~/code/my-model)")
    if name.lower().replace("-", "_") in _TAKEN_NAMES:
        raise UsageError(f"invalid project name {name!r}: the project depends on a package of "
                         "that name", hint="pick another name, e.g. my-model")
    return name


def parse_template(text: str) -> str:
    template = text.strip().lower()
    if template not in TEMPLATES:
        raise UsageError(f"unknown template {text!r}",
                         hint=f"use one of: {', '.join(TEMPLATES)}")
    return template


def render_project(*, name: str, template: str, image: TorchImage | None,
                   fdl_version: str, fdl_wheel: str) -> dict[str, str]:
    """Every text file of the project, ``{relative path: text}``; the Docker files when
    ``image``. ``fdl_wheel`` is where the project's fdl wheel (``fdl_version``) lies in it, the
    one its pyproject, Makefile and Dockerfile install (:mod:`fdl.scaffold.fdl_wheel`)."""
    spec = TEMPLATES[template]
    values: dict[str, object] = {
        "name": name, "image_name": name.lower(), "template": template,
        "summary": spec.summary, "epochs": spec.epochs, "batch_size": spec.batch_size,
        "training": spec.training,
        "docker": image is not None, "fdl_version": fdl_version, "fdl_wheel": fdl_wheel,
    }
    files = dict(PROJECT_FILES)
    if image is not None:
        values.update(torch_version=image.torch_version, variant=image.variant,
                      index_url=image.index_url, base_image=image.base_image,
                      image_reason=image.reason)
        files.update(DOCKER_FILES)
    return {path: fill(read_template(source.format(template=template)), values)
            for path, source in files.items()}


def read_template(relative: str) -> str:
    """The template file ``relative`` (under ``templates/``) with its partials in place."""
    text = resources.files("fdl.scaffold").joinpath("templates", relative).read_text("utf-8")
    return _PARTIAL_RE.sub(lambda match: read_template(f"{match.group(1)}.tmpl"), text)


def fill(text: str, values: Mapping[str, object]) -> str:
    """``text`` with its sections kept or dropped and its ``{{key}}`` marks replaced."""

    def section(match: re.Match[str]) -> str:
        return match.group(2) if _value(values, match.group(1)) else ""

    def value(match: re.Match[str]) -> str:
        return str(_value(values, match.group(1)))

    return _VALUE_RE.sub(value, _INLINE_RE.sub(section, _BLOCK_RE.sub(section, text)))


def _value(values: Mapping[str, object], key: str) -> object:
    if key not in values:
        raise KeyError(f"template mark {{{{{key}}}}} has no value")  # a bug in a template
    return values[key]
