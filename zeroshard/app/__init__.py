"""The `zeroshard` command line: demo/ (train, compare), estimate/, tune/; the demo's models.

Its dependencies are the `cli` extra (rich, matplotlib, the demo corpus), not the library's: without rich or
matplotlib any import of this package stops with the command that installs them, not with a bare
ImportError (without the corpus, the demo asks for it or for --data FILE).
"""

from importlib.util import find_spec

_missing = [name for name in ("rich", "matplotlib") if find_spec(name) is None]
if _missing:
    raise ImportError(f"zeroshard's command line needs {', '.join(_missing)}, from its optional extra: "
                      "pip install 'zeroshard[cli]' (in a checkout: pip install -c constraints.txt -e \".[cli]\")")
