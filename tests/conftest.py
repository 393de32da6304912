"""Fixtures shared by several test modules: tiny trained runs and the headless browser."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from attnkit.cli import main
from tiny_runs import classification_config, translation_config, write_yaml


def _trained(tmp_path_factory, name: str, make_config) -> Path:
    """A tiny run trained by ``attnkit train`` on the config ``make_config(tmp)`` writes."""
    tmp = tmp_path_factory.mktemp(name)
    config = write_yaml(tmp / "tiny.yaml", make_config(tmp))
    assert main(["train", str(config), "--run-dir", str(tmp / "run")]) == 0
    return tmp / "run"


#: pytest-xdist's name for this worker process (``gw0``, ...), None in a run without workers.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")


def pytest_configure(config) -> None:
    """Under pytest-xdist the workers share the machine's cores: each computes with its share of them (torch's
    default of a thread per core would make each wait for the others at every parallel region)."""
    if WORKER is not None:
        import torch

        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


#: The test files that take longest (40 s or more on 2 cores), slowest first. pytest-xdist (``--dist loadfile
#: --no-loadscope-reorder``, pyproject's addopts) hands out whole files in the order collected, so these start first
#: and the short files fill in beside them; a long file handed out last would leave the other workers idle while it
#: ran. (Without ``--no-loadscope-reorder`` xdist orders files by their number of tests, and the documented commands'
#: file, two tests and six minutes, went last.)
SLOW_FILES = ("test_compiled_decoding.py", "test_doc_commands.py", "test_generation_race_bench.py",
              "test_serve_lm.py", "test_generate_cli.py", "test_prepare.py", "test_quantize.py",
              "test_config_pairs.py", "test_attention_alignment.py", "test_serve.py", "test_pretrain.py",
              "test_interop_marian.py", "test_distributed.py", "test_attention_maps.py", "test_export.py",
              "test_experiments.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow files first (:data:`SLOW_FILES`), each file's tests in their own order."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))


@pytest.fixture(autouse=True, scope="session")
def compiled_step_cache(tmp_path_factory) -> None:
    """Compiled decoding steps are kept in a cache of this test run's own, not the user's; the workers of one run
    share it (a package is written whole or not at all, :func:`attnkit.engine.aot.load_or_compile`), so a program
    one worker compiled is loaded by the others."""
    base = tmp_path_factory.getbasetemp()
    cache = (base.parent if WORKER is not None else base) / "attnkit-cache"
    cache.mkdir(exist_ok=True)
    os.environ["ATTNKIT_CACHE"] = str(cache)


@pytest.fixture(scope="module")
def one_thread():
    """A module's tests compute with one torch thread (its servers' worker threads and the tests' own checks share
    the cores); the thread count is restored after the module."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def translation_run(tmp_path_factory) -> Path:
    return _trained(tmp_path_factory, "translation", translation_config)


@pytest.fixture(scope="module")
def classifier_run(tmp_path_factory) -> Path:
    return _trained(tmp_path_factory, "classification", classification_config)


@pytest.fixture
def text(tmp_path: Path) -> Path:
    """A tiny text file to pretrain on: 200 short generated movie sentences, one per line."""
    from test_pretrain import sentences

    path = tmp_path / "text.txt"
    path.write_text("".join(s + "\n" for s in sentences(200)), encoding="utf-8")
    return path


def _browser() -> tuple[str, str]:
    """(chromium, chromedriver) paths, or skip (fail under CI) saying what is missing."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    missing = [name for name, path in (("chromium", chromium), ("chromium-driver", driver)) if path is None]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium Python package (pip install -e '.[dev]')")
    if missing:
        reason = (f"no headless browser for the browser tests: missing {', '.join(missing)}; "
                  "on Debian/Ubuntu: sudo apt-get install chromium chromium-driver (.ci/run does)")
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return chromium, driver


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium driven by Selenium (Debian's ``chromium`` and ``chromium-driver``, installed by
    ``.ci/run``). Without them the test skips and says what to install; under CI (``CI=true``) it fails
    instead, since ``.ci/run`` installs them and a silent skip would hide a broken page."""
    chromium, driver_path = _browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    yield driver
    driver.quit()
