"""What `fdl init` renders: names, templates, every file of every template, the marks."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import GUARD_S

from fdl.errors import UsageError
from fdl.launch.config_file import load_config_file
from fdl.scaffold.docker import TorchImage
from fdl.scaffold.render import (
    DOCKER_FILES,
    PROJECT_FILES,
    TEMPLATES,
    fill,
    parse_template,
    read_template,
    render_project,
    validate_name,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

IMAGE = TorchImage("2.14.0", "cu126", "12.6", "https://download.pytorch.org/whl/cu126",
                   "covers every GPU here: NVIDIA GeForce RTX 4090 (sm_89)")
CASES = [(template, image) for template in TEMPLATES for image in (IMAGE, None)]
WHEEL = "wheels/fdl-0.1.0-py3-none-any.whl"


def render(**kwargs) -> dict[str, str]:
    """The project's text files, its fdl wheel at WHEEL."""
    return render_project(fdl_version="0.1.0", fdl_wheel=WHEEL, **kwargs)


@pytest.mark.parametrize("name", ["demo", "my-model", "A1_b-2", "x"])
def test_valid_names(name):
    assert validate_name(name) == name


@pytest.mark.parametrize("name", ["", "1demo", "-demo", "_demo", "my model", "demo.py",
                                  "dé", "a/b", "torch", "FDL", "NumPy", "PyTest"])
def test_invalid_names_are_usage_errors(name):
    with pytest.raises(UsageError) as info:
        validate_name(name)
    assert repr(name) in info.value.message
    assert info.value.exit_code == 2 and info.value.hint


def test_unknown_template_names_the_choices():
    with pytest.raises(UsageError) as info:
        parse_template("rnn")
    assert "'rnn'" in info.value.message and info.value.hint == "use one of: mlp, cnn, gpt, loop"
    assert parse_template(" GPT ") == "gpt"


@pytest.mark.parametrize(("template", "image"), CASES)
def test_every_file_renders_without_leftover_marks(template, image):
    files = render(name="demo", template=template, image=image)
    expected = set(PROJECT_FILES) | (set(DOCKER_FILES) if image else set())
    assert set(files) == expected
    for path, text in files.items():
        assert "{{" not in text and "}}" not in text, path
        assert text.endswith("\n") and not text.endswith("\n\n"), path


@pytest.mark.parametrize(("template", "image"), CASES)
def test_python_files_parse_and_train_py_has_a_main_guard(template, image):
    files = render(name="demo", template=template, image=image)
    for path in ("train.py", "tests/test_train.py"):
        ast.parse(files[path], filename=path)
    train = files["train.py"]
    assert 'if __name__ == "__main__":\n    main()' in train
    assert "init_process_group" not in train  # the Trainer owns distribution
    for function in ("load_data", "build_model", "build_optimizer", "train_step", "evaluate"):
        assert f"\ndef {function}(" in train
    spec = TEMPLATES[template]
    assert f"EPOCHS = {spec.epochs}\n" in train and f"BATCH_SIZE = {spec.batch_size} " in train


def test_the_loop_template_is_the_gpt_template_s_model_in_a_loop_of_its_own():
    loop = render(name="demo", template="loop", image=None)
    gpt = render(name="demo", template="gpt", image=None)
    for part in ("data", "model", "evaluate", "text"):  # written once, in both projects
        shared = read_template(f"gpt/{part}.py.tmpl")
        assert shared in loop["train.py"] and shared in gpt["train.py"], part
    train = loop["train.py"]
    assert "fdl.Trainer" not in train
    for call in ("fdl.init(", "run.batches(", "accumulate=ACCUMULATE", "max_steps=MAX_STEPS",
                 "with run.autocast():", "run.scaler", "run.state(scaler=run.scaler)",
                 "run.evaluate(eval_set, evaluate)", "run.log(loss=loss)",
                 "learning_rate(run.progress)", "clip_grad_norm_(model.parameters()",
                 "torch.compile(model, dynamic=True) if COMPILE else model", "run.finish()"):
        assert call in train, call
    for torchrun_part in ("DistributedDataParallel", "DistributedSampler", "set_epoch",
                          "destroy_process_group"):
        assert torchrun_part not in train, torchrun_part
    assert "its own training loop on `fdl.init()`" in loop["README.md"]
    assert "`fdl.Trainer(...).fit()`" in gpt["README.md"]


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_fdl_toml_is_accepted_by_fdl_run(template, tmp_path):
    files = render(name="demo", template=template, image=None)
    (tmp_path / "fdl.toml").write_text(files["fdl.toml"])
    values, path = load_config_file(tmp_path)
    spec = TEMPLATES[template]
    assert path == tmp_path / "fdl.toml"
    assert values == {"policy": "cadence", "backend": "auto", "epochs": spec.epochs,
                      "batch_size": spec.batch_size}


def test_pyproject_depends_on_its_fdl_with_torch_and_on_pytest():
    files = render(name="my-model", template="mlp", image=None)
    pyproject = tomllib.loads(files["pyproject.toml"])
    assert pyproject["project"]["name"] == "my-model"
    # the version of the wheel in wheels/, which `make install` finds there; pytest for `make
    # test`, wherever the project is installed (a fresh venv, the image)
    assert pyproject["project"]["dependencies"] == ["fdl[torch]==0.1.0", "pytest>=8"]
    assert "optional-dependencies" not in pyproject["project"]
    assert pyproject["tool"]["pytest"]["ini_options"]["pythonpath"] == ["."]


def test_makefile_targets_and_docker_switch():
    with_docker = render(name="Demo", template="mlp", image=IMAGE)["Makefile"]
    without = render(name="Demo", template="mlp", image=None)["Makefile"]
    for target in ("train:", "compare:", "test:"):
        assert f"\n{target}\n\t" in with_docker and f"\n{target}\n\t" in without
    assert "\ndocker-build:\n\tdocker build -t $(IMAGE) .\n" in with_docker
    assert "IMAGE ?= demo\n" in with_docker  # Docker image names are lower case
    assert "docker" not in without.lower()
    compare = ("\ncompare:\n\t$(FDL) compare train.py --policies $(POLICIES) --epochs $(EPOCHS) "
               "--seeds $(SEEDS) --quiet-ranks\n")
    assert compare in with_docker and compare in without
    assert "POLICIES ?= sync,cadence,async\nEPOCHS ?= 5\nSEEDS ?= 1\n" in without
    install = "\ninstall:\n\t$(PYTHON) -m pip install --find-links wheels -e .\n"
    assert install in with_docker and install in without
    assert f"fdl 0.1.0 from {WHEEL}" in without


def test_dockerfile_installs_the_chosen_wheel_on_its_cuda_base():
    files = render(name="demo", template="gpt", image=IMAGE)
    dockerfile = files["Dockerfile"]
    assert "FROM nvidia/cuda:12.6.3-runtime-ubuntu22.04\n" in dockerfile
    assert "ARG TORCH_VERSION=2.14.0\n" in dockerfile
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126\n" in dockerfile
    assert IMAGE.reason in dockerfile
    # fdl from the wheel beside the Dockerfile, before the rest of the project and after torch
    install_fdl = (f"COPY {WHEEL} {WHEEL}\n"
                   f'RUN python3 -m pip install "./{WHEEL}[torch]"\n'
                   "COPY . .\nRUN python3 -m pip install --find-links wheels .\n")
    assert install_fdl in dockerfile
    assert dockerfile.index("torch==${TORCH_VERSION}") < dockerfile.index(install_fdl)
    assert "runs/" in files[".dockerignore"] and ".venv/" in files[".dockerignore"]


def test_readme_gives_the_three_commands_and_gitignore_the_outputs():
    files = render(name="demo", template="cnn", image=None)
    readme = files["README.md"]
    for command in ("make install", WHEEL, "fdl run train.py", "make compare",
                    "fdl compare train.py --epochs 3", "compare.md", "fdl report runs/",
                    "summary.json", "fdl diagnose"):
        assert command in readme
    assert "Dockerfile" not in readme and "compare.py" not in readme
    assert files[".gitignore"].splitlines()[:2] == ["runs/", ".venv/"]


def test_fill_sections_inline_and_on_their_own_lines():
    text = "a{{#on}} b{{/on}}{{#off}} c{{/off}}\n{{#off}}\ngone\n{{/off}}\n{{#on}}\n{{x}}\n{{/on}}\nz\n"
    assert fill(text, {"on": True, "off": False, "x": 1}) == "a b\n1\nz\n"


def test_a_partial_is_the_text_of_its_file_in_place_of_its_line():
    template = read_template("gpt/train.py.tmpl")
    model = read_template("gpt/model.py.tmpl")
    assert "{{>" not in template and model.startswith("# --- model ---")
    # the mark's line is replaced by the part, which ends its own last line
    assert f"\n\n\n{model}\n\n# --- training ---" in template


def test_fill_rejects_a_mark_without_a_value():
    with pytest.raises(KeyError, match="nope"):
        fill("{{nope}}", {})


def test_templates_are_package_data(tmp_path):
    """A wheel built from this checkout (offline, as pip builds it for an install) carries every
    template file that render_project reads, byte for byte, and no stray file in templates/."""
    root = Path(__file__).parents[2]
    templates = root / "fdl" / "scaffold" / "templates"
    source = tmp_path / "source"  # a copy: building in place would leave build/ in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    shutil.copytree(root / "fdl", source / "fdl",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "--no-index", "--disable-pip-version-check",
                           "-q", "-w", str(tmp_path / "dist"), str(source)],
                          capture_output=True, text=True, timeout=GUARD_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("fdl-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packaged = {name.removeprefix("fdl/scaffold/templates/"): archive.read(name)
                    for name in archive.namelist()
                    if name.startswith("fdl/scaffold/templates/")}
    sources = {*PROJECT_FILES.values(), *DOCKER_FILES.values()}
    needed = {source.format(template=template) for template in TEMPLATES for source in sources}
    needed |= {str(path.relative_to(templates)) for path in templates.rglob("*.tmpl")}  # partials
    assert needed <= set(packaged), sorted(needed - set(packaged))
    for name in needed:
        assert packaged[name] == (templates / name).read_bytes(), name
    assert all(name.endswith(".tmpl") for name in packaged), sorted(packaged)
