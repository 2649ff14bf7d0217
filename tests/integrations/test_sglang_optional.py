"""Without SGLang: the adapter module still imports, the class and the bench say what is missing.

Runs in a subprocess whose import system refuses ``sglang`` (so it holds with SGLang installed).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys

    class NoSGLang:
        def find_spec(self, name, path=None, target=None):
            if name == "sglang" or name.startswith("sglang."):
                raise ImportError(f"No module named {name!r} (blocked by the test)")

    sys.meta_path.insert(0, NoSGLang())
    import tierstore.integrations.sglang as adapter

    assert adapter.SGLANG_IMPORT_ERROR is not None
    try:
        adapter.TierStoreHiCacheStorage(None)
    except ImportError as exc:
        print("CLASS:", exc)
    from tierstore.cli import main

    main(["bench", "sglang", "--json"])
""")


def test_module_imports_and_explains_without_sglang() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "CLASS: TierStoreHiCacheStorage needs SGLang: pip install --no-deps sglang==0.5.23" \
        in done.stdout
    assert "SGLang is not importable here" in done.stdout
    assert '"available": false' in done.stdout
