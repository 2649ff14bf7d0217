"""The compiled modules against hostile input: callbacks (``__index__``, ``__eq__``,
``__hash__``, ``__del__``) that change the lists, dicts and tables a C loop holds, and sizes
that overflow. Each case runs in a child process, so a crash or a heap corruption fails the case
(with the child's output) instead of the test run; a case expects a named exception, or a result
the pure path would give, and never a crash."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tierstore.native import load

ROOT = Path(__file__).resolve().parents[1]

slots_c = load("gpu_arena._c_slots")
ghost_c = load("tierstore._c_ghost")
mrc_c = load("tierstore._c_mrc")
chain_c = load("tierstore._c_chain")
held_c = load("tierstore._c_held")


def _skip_unless(module: object, name: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(module is None, reason=f"{name} not built or TIERSTORE_PURE_PYTHON=1")


needs_slots = _skip_unless(slots_c, "gpu_arena._c_slots")
needs_ghost = _skip_unless(ghost_c, "tierstore._c_ghost")
needs_mrc = _skip_unless(mrc_c, "tierstore._c_mrc")
needs_chain = _skip_unless(chain_c, "tierstore._c_chain")
needs_held = _skip_unless(held_c, "tierstore._c_held")

SLOTS_PRELUDE = """
import numpy as np
from gpu_arena._c_slots import SlotLoops

def tables(n):
    return (np.full(n, -1, np.int64), np.full(n, -1, np.int64), np.zeros(n, np.int32),
            np.zeros(n, np.int32), np.arange(n, dtype=np.int64))
"""


def run_case(code: str, prelude: str = "") -> str:
    """Run ``code`` in a child interpreter (this one's modules, sys.path and environment); its
    stdout, after asserting it exited cleanly and printed ``OK`` last."""
    src = textwrap.dedent(prelude) + textwrap.dedent(code) + "\nprint('OK')\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", src], env=env,
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("OK"), (
        f"child exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
        f"stderr:\n{proc.stderr[-3000:]}")
    return proc.stdout


# --- gpu_arena._c_slots ----------------------------------------------------------------------


@needs_slots
def test_slots_release_top_overflow_is_refused() -> None:
    """top + len(ids) past 2**63 wrapped and passed the bound check: the push wrote 8 bytes
    before the free-id table (release then; free, which took its place, since)."""
    run_case("""
        t = tables(8)
        loops = SlotLoops(*t)
        ids = loops.bind([3], 8)
        before = [a.copy() for a in t]
        for top in (2**63 - 1, 2**63 - 8):
            try:
                loops.free(ids, top, False, 0, 8, 1, 0, -1)
            except ValueError:
                pass
            else:
                raise SystemExit(f"free at top={top} was accepted")
        assert all((a == b).all() for a, b in zip(t, before)), "a refused free changed a table"
    """, SLOTS_PRELUDE)


@needs_slots
def test_slots_init_from_a_callback_is_refused() -> None:
    """An id's __index__ that re-initialises the loops on tiny tables (dropping the old ones)
    while bind runs: the loops must refuse, not write through the old sizes."""
    run_case("""
        t = tables(64)
        loops = SlotLoops(*t)
        del t

        class Evil:
            def __index__(self):
                loops.__init__(*tables(1))
                return 0

        try:
            loops.bind([Evil()], 64)
        except (RuntimeError, TypeError):  # (the loops report a failed __index__ as TypeError)
            pass
        else:
            raise SystemExit("bind went on after its tables were replaced")
        assert loops.bind([1], 64) == [63], "the loops lost their tables to a callback"
    """, SLOTS_PRELUDE)


@needs_slots
def test_slots_take_bind_checks_free_ids_after_callbacks() -> None:
    """take_bind once checked the free ids before reading entries that could run Python code
    (the hole heap was a list then); its arguments' __index__ still runs: an id changed there
    must be refused, not used as an index into loc."""
    run_case("""
        t = tables(8)
        loops = SlotLoops(*t)
        loops.add([3])
        loc, owner, free_ids = t[0], t[1], t[4]

        class Evil:
            def __index__(self):
                free_ids[7] = 10**12
                return 8

        try:
            loops.take_bind(0, 8, 1, False, Evil())
        except ValueError:
            pass
        else:
            raise SystemExit("take_bind bound a free id outside the table")
        assert (loc == -1).all() and (owner == -1).all(), "a refused take_bind bound an id"
        assert loops.entries() == [3], "a refused take_bind took a hole"
    """, SLOTS_PRELUDE)


@needs_slots
def test_slots_free_checks_ids_after_callbacks() -> None:
    """free reads every id (an id's __index__ may run Python code that changes the tables)
    before it checks any: an id made not live by a callback is refused, nothing changed."""
    run_case("""
        t = tables(8)
        loops = SlotLoops(*t)
        ids = loops.bind([2, 5], 8)
        loc = t[0]

        class Evil:
            def __index__(self):
                loc[ids[1]] = 10**12
                return ids[0]

        before = [a.copy() for a in t]
        try:
            loops.free([Evil(), ids[1]], 6, False, 0, 8, 2, 0, 0)
        except ValueError:
            pass
        else:
            raise SystemExit("free unbound an id whose slot was outside the table")
        assert all((a == b).all() for a, b in zip(t[1:], before[1:])), "a refused free changed"
        assert len(loops) == 0, "a refused free added holes"
    """, SLOTS_PRELUDE)


# --- tierstore._c_mrc ------------------------------------------------------------------------

MRC_PRELUDE = """
from tierstore import _c_mrc as c

def slots(n=512):
    return [0.0] * n, [0.0] * ((n + 255) // 256)

def refused(call, *args):
    try:
        call(*args)
    except TypeError as exc:
        return str(exc)
    raise SystemExit(f"{call.__name__} accepted a hostile item")
"""


@needs_mrc
def test_mrc_touch_page_code_with_index_is_refused() -> None:
    """A page's code read with PyLong_AsLongLong ran its __index__, which emptied the slots;
    the loop then wrote into the emptied list (a NULL item array: SIGSEGV)."""
    run_case("""
        values, sums = slots()

        class Code:
            def __index__(self):
                values.clear()
                return 200

        pages = {b"k": Code()}
        refused(c.touch, pages, values, sums, 1.0, 1.0, [b"k"], [0], None, True, 0)
    """, MRC_PRELUDE)


@needs_mrc
def test_mrc_reference_position_with_hash_is_refused() -> None:
    """A sampled position (an int subclass) whose __hash__ empties the slots when it is stored
    in ``seen``: the next page's distance was summed over the freed item array."""
    run_case("""
        values, sums = [1.0] * 512, [256.0, 256.0]

        class Pos(int):
            def __hash__(self):
                values.clear()
                sums.clear()
                return 0

        pages = {b"a": 0, b"b": 2}
        why = refused(c.reference, pages, values, sums, [b"a", b"b"], [Pos(0), 1], None, 5,
                      10, [1.0, 100.0], [0.0, 0.0, 0.0], 1, 1.0, 1.0, [], [], {}, [], {})
        assert "position" in why, why  # (not a read of freed items that happened to fail)
    """, MRC_PRELUDE)


@needs_mrc
def test_mrc_reference_edge_with_float_is_refused() -> None:
    """A histogram edge whose __float__ empties the slots (bisect ran it); the next page's
    distance was then summed over the freed item array."""
    run_case("""
        values, sums = [1.0] * 512, [256.0, 256.0]

        class Edge:
            def __float__(self):
                values.clear()
                sums.clear()
                return 1.0

        pages = {b"a": 0, b"b": 2}
        why = refused(c.reference, pages, values, sums, [b"a", b"b"], [0, 1], None, 5, 10,
                      [Edge(), 100.0], [0.0, 0.0, 0.0], 1, 1.0, 1.0, [], [], {}, [], {})
        assert "edge" in why, why  # (not a read of freed items that happened to fail)
    """, MRC_PRELUDE)


@needs_mrc
def test_mrc_touch_replaced_slot_with_del_is_refused() -> None:
    """The slot touch overwrites held an object whose __del__ emptied the sums; the loop then
    added to a sum of the emptied list."""
    run_case("""
        values, sums = slots()

        class Old:
            def __del__(self):
                sums.clear()

        values[0] = Old()
        refused(c.touch, {}, values, sums, 1.0, 1.0, [b"k"], [0], None, True, 0)
    """, MRC_PRELUDE)


@needs_mrc
def test_mrc_touch_end_with_eq_is_refused() -> None:
    """An end position whose __eq__ empties the sampled list while touch asks whether a new
    page is an end: the loop then read the emptied list."""
    run_case("""
        values, sums = slots()
        sampled = [0, 1]

        class End(int):
            def __eq__(self, other):
                sampled.clear()
                return False

            __hash__ = int.__hash__

        refused(c.touch, {}, values, sums, 1.0, 1.0, [b"a", b"b"], sampled, [End(5)], True, 0)
    """, MRC_PRELUDE)



@needs_mrc
def test_mrc_scan_end_set_key_with_eq_is_refused() -> None:
    """A key stored in the end set that collides with a page key and empties the keys when
    compared: scan went on reading the freed keys (the one being looked up, then the rest)."""
    run_case("""
        keys = [bytes([i]) * 32 for i in range(8)]  # (made at run time: only the list holds them)

        class Collider:
            def __hash__(self):
                return hash(keys[0])

            def __eq__(self, other):
                keys.clear()
                return False

        try:
            c.scan(keys, b"\\xff" * 32, {Collider(): None}, 2**32, 2**32, -1, None, [])
        except RuntimeError:
            pass
        else:
            raise SystemExit("scan went on over keys that changed")
    """, MRC_PRELUDE)



@needs_mrc
def test_mrc_scan_key_replaced_by_a_lookup_is_refused() -> None:
    """An end set's stored key whose __eq__ replaces a page key with an int (the list keeps its
    size): scan then read the int as bytes when it sampled the ends."""
    run_case("""
        keys = [bytes([i]) * 32 for i in range(8)]

        class Collider:
            def __hash__(self):
                return hash(keys[7])

            def __eq__(self, other):
                keys[0] = 12345
                return False

        end_set = {Collider(): None, keys[0]: None}
        try:
            c.scan(keys, b"\\xff" * 32, end_set, 2**31, 2**32, -1, None, [])
        except RuntimeError:
            pass
        else:
            raise SystemExit("scan read a replaced key")
    """, MRC_PRELUDE)

@needs_mrc
def test_mrc_reference_refs_key_with_eq_is_refused() -> None:
    """A key stored in the kinds' reference counts that collides with a kind and empties the
    kinds list when compared: the lookup went on with the freed kind (only the pair held it)."""
    run_case("""
        values, sums = [1.0] * 512, [256.0, 256.0]
        kinds = [([0.0] * 4, "k" + str(len(values)))]  # (made at run time)

        class Collider:
            def __hash__(self):
                return hash(kinds[0][1]) if kinds else 0

            def __eq__(self, other):
                kinds.clear()
                return False

        refs = {Collider(): 0.0}  # (the kind itself is not there: only the pair holds it)
        try:
            c.reference({b"a": 0}, values, sums, [b"a"], [0], None, 5, 10, [1.0, 100.0],
                        [0.0, 0.0, 0.0], 1, 1.0, 1.0, kinds, [], refs, [], {})
        except (RuntimeError, TypeError, KeyError):
            pass
    """, MRC_PRELUDE)


@needs_mrc
def test_mrc_reference_page_overflow_is_refused() -> None:
    """An end's tokens (pages since the last end times the page size) past 2**63: a signed
    overflow (undefined behaviour; UBSan reports it)."""
    run_case("""
        values, sums = [1.0] * 512, [256.0, 256.0]
        try:
            c.reference({b"a": 0, b"b": 2}, values, sums, [b"a", b"b"], [0, 1], [1], 5, 10,
                        [1.0, 100.0], [0.0, 0.0, 0.0], 2**62, 1.0, 1.0, [], [], {}, [], {})
        except ValueError:
            pass
        else:
            raise SystemExit("reference multiplied past 2**63")
    """, MRC_PRELUDE)

# --- tierstore._c_ghost ----------------------------------------------------------------------


@needs_ghost
def test_ghost_tally_holds_the_count_over_a_key_hash() -> None:
    """tally's slot lookup hashes the key (Python code for a non-str key); a __hash__ that
    empties the counts dict freed the count still borrowed from it, which was then added (a
    use-after-free: the sum read whatever reused the memory)."""
    run_case("""
        from tierstore._c_ghost import tally

        armed = False
        junk = []

        class Reason:
            def __hash__(self):
                if armed:
                    counts.clear()  # drops the only reference to the count
                    junk.extend(int("8" * 31) + i for i in range(64))  # reuses its memory
                return 1

        reason = Reason()
        counts = {reason: int("9" * 31)}  # (made at run time: no constant holds it)
        c, lost_slots = [0] * 8, {reason: 3}
        armed = True
        try:
            tally(lost_slots, {}, c, {}, counts, {})
        except RuntimeError:  # (a dict changed during the tally may be refused)
            pass
        churn = [int("7" * 31) + i for i in range(256)] + [b"x" * (i % 64) for i in range(256)]
        got = c[3]  # (a dangling item reads as whatever reused its memory)
        assert got == 0 or (type(got) is int and got == int("9" * 31)), f"freed memory: {got!r}"
    """)


@needs_held
def test_held_survives_a_namespace_and_a_ghost_that_change_what_it_holds() -> None:
    """settle looks the namespace up (its __eq__ may empty the counts dict that lends the
    counters) and asks the ghost (a __contains__ may empty the keys list): it holds what it
    goes on with, so the counters it adds to stay alive and the keys it read stay read."""
    run_case("""
        from tierstore._c_held import Held

        class Namespace(str):
            def __hash__(self):
                return hash("default")

            def __eq__(self, other):
                counts.clear()  # drops the dict's reference to the counters
                junk.extend([int("8" * 31) + i] * 9 for i in range(64))
                return True

        class Ghost:
            def __contains__(self, key):
                keys.clear()
                return False

        junk = []
        counts = {"default": [int("9" * 31)] * 9}
        keys = [b"a" * 32, b"b" * 32]
        held = Held(Ghost(), counts, 16, (9, 1, 5, 7), print, lambda: None, 100)
        lost, evicted = held.settle(Namespace("x"), 33, keys, None, 1, {})
        assert lost == {"cold": 16, "partial_page": 1} and evicted == {}, lost
        assert held.requests == 1 and held.shared == 1
    """)


# --- tierstore._c_chain (no callbacks can run inside it: sizes and overflow only) --------------


@needs_chain
@pytest.mark.parametrize("args", [
    (bytes(32), bytes(96), 32, 2**62, 2**62),  # first + count past 2**63
    (bytes(32), bytes(96), 32, 0, 2**63 - 1),
    (bytes(32), bytes(96), 2**63, 0, 0),  # (too large: ValueError, not OverflowError)
    (bytes(32), bytes(96), 32, -1, 1),
    (bytes(31), bytes(96), 32, 0, 1),
])
def test_chain_refuses_sizes_past_the_buffer(args: tuple[object, ...]) -> None:
    ch: Any = chain_c
    with pytest.raises(ValueError):
        ch.chain(*args)


@needs_chain
def test_chain_pack_refuses_counts_past_the_buffer() -> None:
    import numpy as np

    ch: Any = chain_c
    tokens = np.arange(8, dtype=np.uint32)
    with pytest.raises(ValueError):
        ch.pack(tokens, 2**62)
    assert ch.pack(tokens[::2], 2) is None  # (strided)
    assert ch.pack(tokens.reshape(2, 4), 2) is None
    with pytest.raises(ValueError):  # out one item short
        ch.narrow_i64(np.arange(8, dtype=np.int64), np.zeros(7, np.uint32))
    with pytest.raises((BufferError, TypeError)):  # out read-only
        ch.pack_ints([1, 2], bytes(8))
    with pytest.raises(TypeError):  # a list subclass (its own __getitem__ would be skipped)
        ch.pack_ints(type("L", (list,), {})([1, 2]), np.zeros(2, np.uint32))
