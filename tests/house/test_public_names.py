"""Tab completion on a public module lists its API (`__all__`), not what the module happens to
import."""

import importlib
import pkgutil

import speedtronic

from IPython.core.completer import provisionalcompleter
from IPython.core.interactiveshell import InteractiveShell

SCRIPT_MODULES = {"speedtronic.__main__", "speedtronic._modidx"}


def public_modules() -> list[str]:
    return sorted(
        m.name
        for m in pkgutil.walk_packages(speedtronic.__path__, "speedtronic.")
        if m.name not in SCRIPT_MODULES
    )


def test_every_module_lists_only_its_public_names():
    leaks = {}
    for name in public_modules():
        module = importlib.import_module(name)
        public = set(getattr(module, "__all__", ()))
        extra = {n for n in dir(module) if not n.startswith("_")} - public
        if name == "speedtronic.distributed":
            extra -= {m.name.rpartition(".")[2] for m in pkgutil.iter_modules(module.__path__)}
        if extra:
            leaks[name] = sorted(extra)[:8]
    assert not leaks, leaks


def test_ipython_completes_the_api_only():
    shell = InteractiveShell.instance()
    shell.run_cell("import speedtronic.config, speedtronic.trainer")
    for jedi in (True, False):
        shell.Completer.use_jedi = jedi
        with provisionalcompleter():
            names = {
                c.text.lstrip(".")
                for c in shell.Completer.completions(
                    "speedtronic.config.", len("speedtronic.config.")
                )
            }
        assert "SpeedtronicConfig" in names and "load_config" in names, names
        assert not names & {"os", "json", "yaml", "dataclasses", "Path"}, names & {
            "os",
            "json",
            "yaml",
            "dataclasses",
            "Path",
        }
