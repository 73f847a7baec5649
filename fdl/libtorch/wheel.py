"""The command that installs a torch wheel covering every GPU, as data: what runs and what a
person reads.

A :class:`TorchInstall` holds the words of the command (``argv``), any environment it needs
(``env``) and a trailing note that is never part of what runs; ``str()`` derives the display
from them, so the command ``fdl setup --install-torch`` runs and the one ``fdl diagnose`` and
``fdl setup`` print cannot drift apart (``shlex.split`` of the display, without the note, gives
back the env assignments and ``argv``).

    >>> str(torch_install(advice))   # an official wheel covers every GPU
    "pip install --force-reinstall 'torch==2.14.0' --index-url https://download.pytorch.org/whl/cu126"
    >>> str(torch_install(advice))   # none does: a source build, which fdl shows but never runs
    'TORCH_CUDA_ARCH_LIST="6.1;12.0" USE_CUDA=1 python -m pip install --no-build-isolation -v .  # in a checkout of the release: ...'
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from fdl.libtorch.catalog import latest_version
from fdl.libtorch.coverage import BuildAdvice

INDEX_URL = "https://download.pytorch.org/whl"
_SPECIFIERS = ("==", ">=", "<=", "~=", "!=")


@dataclass(frozen=True)
class TorchInstall:
    argv: tuple[str, ...]  # as a person types it: ("pip", "install", ...)
    env: tuple[tuple[str, str], ...] = ()  # NAME=value set before it
    note: str | None = None  # shown after "  # "; never run

    @property
    def is_wheel(self) -> bool:
        """True for a plain ``pip install`` of a published wheel: the one kind fdl runs itself
        (a source build needs a pytorch checkout and hours)."""
        return not self.env and self.argv[:2] == ("pip", "install")

    def __str__(self) -> str:
        words = [f"{name}={_quote_value(value)}" for name, value in self.env]
        text = " ".join([*words, *map(_quote_word, self.argv)])
        return f"{text}  # {self.note}" if self.note else text


CPU_WHEEL = TorchInstall(("pip", "install", "torch", "--index-url", f"{INDEX_URL}/cpu"))


def torch_install(advice: BuildAdvice) -> TorchInstall | None:
    """The wheel that covers every GPU (``advice.recommended``), else the source build for
    exactly their architectures; None when neither is known."""
    if advice.recommended:
        version, variant = advice.recommended.label.removeprefix("torch ").split("+", 1)
        return TorchInstall(("pip", "install", "--force-reinstall", f"torch=={version}",
                             "--index-url", f"{INDEX_URL}/{variant}"))
    if advice.source_arch_list:
        return TorchInstall(
            ("python", "-m", "pip", "install", "--no-build-isolation", "-v", "."),
            env=(("TORCH_CUDA_ARCH_LIST", advice.source_arch_list), ("USE_CUDA", "1")),
            note=f"in a checkout of the release: git clone --recursive --branch "
                 f"v{latest_version()} https://github.com/pytorch/pytorch; 2-6 hours of "
                 "compiling and tens of GB of disk")
    return None


def _quote_word(word: str) -> str:
    # shlex leaves "=" bare; a requirement with a version specifier is single-quoted the way
    # pip's documentation writes it, so ">=" pasted into a shell stays part of the word.
    if any(op in word for op in _SPECIFIERS) and "'" not in word:
        return f"'{word}'"
    return shlex.quote(word)


def _quote_value(value: str) -> str:
    # TORCH_CUDA_ARCH_LIST="6.1;12.0" as PyTorch's build docs write it; a switch (1, ON) bare.
    if value.isalnum():
        return value
    if any(c in value for c in '"$`\\!'):
        return shlex.quote(value)
    return f'"{value}"'
