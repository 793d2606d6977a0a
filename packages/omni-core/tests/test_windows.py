import numpy as np
import pytest
from omni_core.dataplane.windows import Piece, RunPiece, WindowState
from omni_core.events import ShmHandle


def piece(seq, tokens, handles=()):
    return Piece(seq, list(tokens), {}, {"seq": seq}, list(handles))


def feed(ws, chunks, last_on_final=True):
    out = []
    for i, c in enumerate(chunks):
        out += ws.push(piece(i, c), is_last=last_on_final and i == len(chunks) - 1)
    return out


def test_full_window_triggers_only_at_end():
    ws = WindowState("a", -1)
    assert ws.push(piece(0, [1, 2])) == []
    assert ws.push(piece(1, [3])) == []
    (w,) = ws.push(piece(2, [4]), is_last=True)
    assert w.tokens == [1, 2, 3, 4] and w.is_last and w.index == 0 and w.overlap == 0


def test_full_window_on_completed_without_is_last():
    ws = WindowState("a", -1)
    ws.push(piece(0, [1, 2]))
    (w,) = ws.end()
    assert w.tokens == [1, 2] and w.is_last
    assert ws.end() == []


def test_size_n_windows_and_remainder():
    ws = WindowState("a", 4)
    windows = feed(ws, [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9, 10]])
    assert [w.tokens for w in windows] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert [w.is_last for w in windows] == [False, False, True]
    assert [w.start for w in windows] == [0, 4, 8]


def test_exact_multiple_ends_with_an_empty_last_window():
    ws = WindowState("a", 2)
    windows = feed(ws, [[0, 1], [2, 3]])
    assert [w.tokens for w in windows] == [[0, 1], [2, 3], []]
    assert windows[-1].is_last and not windows[1].is_last


def test_overlap_prepends_left_context():
    ws = WindowState("a", 3, overlap=2)
    windows = feed(ws, [[0, 1, 2, 3, 4, 5, 6, 7]])
    assert [w.tokens for w in windows] == [[0, 1, 2], [1, 2, 3, 4, 5], [4, 5, 6, 7]]
    assert [w.overlap for w in windows] == [0, 2, 2]
    assert [w.new_tokens for w in windows] == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_one_big_piece_yields_many_windows():
    ws = WindowState("a", 1)
    windows = ws.push(piece(0, range(5)), is_last=True)
    assert [w.tokens for w in windows] == [[0], [1], [2], [3], [4], []]


def test_array_rows_are_units_and_windows_are_views():
    ws = WindowState("a", 2)
    arr = np.arange(10).reshape(5, 2)
    windows = ws.push(Piece(0, None, {"h": arr}, {}), is_last=True)
    assert [w.arrays["h"].tolist() for w in windows] == [
        [[0, 1], [2, 3]],
        [[4, 5], [6, 7]],
        [[8, 9]],
    ]
    assert np.shares_memory(windows[0].arrays["h"], arr)


def test_arrays_concatenate_across_pieces():
    ws = WindowState("a", -1)
    ws.push(Piece(0, None, {"h": np.ones((2, 3))}, {}))
    (w,) = ws.push(Piece(1, None, {"h": np.zeros((1, 3))}, {}), is_last=True)
    assert w.arrays["h"].shape == (3, 3)


def test_mismatched_array_shapes_name_the_edge():
    ws = WindowState("up", -1)
    ws.push(Piece(0, None, {"img": np.ones((1, 4, 4))}, {}))
    (w,) = ws.push(Piece(1, None, {"img": np.ones((1, 8, 8))}, {}), is_last=True)
    with pytest.raises(ValueError, match="edge 'up'"):
        _ = w.arrays
    assert len(w.pieces) == 2


def test_pieces_without_units_ride_with_their_window():
    ws = WindowState("a", 2)
    out = ws.push(piece(0, [1, 2]))
    out += ws.push(Piece(1, [], {}, {"final": True}), is_last=True)
    assert out[-1].is_last and out[-1].payloads == [{"final": True}]


def _h(off):
    return ShmHandle("seg", off, 10, "|u1", (10,), "up")


def test_slots_are_released_once_no_window_needs_them():
    ws = WindowState("a", 2, overlap=1)
    w0 = ws.push(piece(0, [0, 1], [_h(0)]))[0]
    assert w0.release == []  # token 1 is context for the next window
    w1 = ws.push(piece(1, [2, 3], [_h(64)]))[0]
    assert w1.release == [_h(0)]
    (end,) = ws.end()
    assert end.release == [_h(64)]


def test_drop_returns_every_held_slot_and_blocks_later_data():
    ws = WindowState("a", -1)
    ws.push(piece(0, [1], [_h(0)]))
    ws.push(piece(1, [2], [_h(64)]))
    assert ws.drop() == [_h(0), _h(64)]
    with pytest.raises(ValueError, match="after the end"):
        ws.push(piece(2, [3]))


@pytest.mark.parametrize("size", [0, -2])
def test_bad_sizes(size):
    with pytest.raises(ValueError):
        WindowState("a", size)


def test_states_are_independent_per_request():
    a, b = WindowState("e", 2), WindowState("e", 2)
    assert a.push(piece(0, [1, 2]))[0].tokens == [1, 2]
    assert b.push(piece(0, [9])) == []


@pytest.mark.parametrize("size,overlap", [(-1, 0), (1, 0), (3, 0), (4, 2), (7, 3), (50, 5)])
def test_pushing_pieces_together_cuts_the_windows_one_by_one_would(size, overlap):
    rng = np.random.default_rng(100 + size * 10 + overlap)
    chunks = [list(range(int(n))) for n in rng.integers(0, 6, 40)]  # empty pieces too

    def key(windows):
        return [(w.index, w.start, w.overlap, w.tokens, w.is_last, w.units) for w in windows]

    one = feed(WindowState("a", size, overlap), chunks)
    many = WindowState("a", size, overlap)
    got = []
    pieces = [piece(i, c) for i, c in enumerate(chunks)]
    for lo in range(0, 40, 9):  # runs of 9, the last one ending the stream
        part = pieces[lo : lo + 9]
        got += many.push_many(part, sum(p.units for p in part), is_last=lo + 9 >= 40)
    assert key(got) == key(one)


def run_piece(first, chunks, logprobs=True):
    tokens = [list(c) if c is not None else None for c in chunks]
    lps = [[-float(t) for t in c] if c is not None else None for c in chunks]
    counts = [1 if c is None else len(c) for c in chunks]
    payloads = [{"seq": first + k} for k in range(len(chunks))]
    return RunPiece(first, tokens, payloads, lps if logprobs else None, counts, sum(counts))


@pytest.mark.parametrize("size,overlap", [(-1, 0), (1, 0), (2, 1), (3, 0), (5, 4), (8, 3), (64, 0)])
def test_runs_kept_in_columns_give_the_windows_their_events_one_by_one_would(size, overlap):
    # segments of 1-4 tokens (some tokenless: one unit each) in runs of 1-12 segments,
    # cut by windows that split segments and runs anywhere
    rng = np.random.default_rng(7 + size + overlap)
    chunks = [
        None if rng.random() < 0.1 else list(range(k * 10, k * 10 + int(rng.integers(1, 5))))
        for k in range(120)
    ]
    one = WindowState("a", size, overlap)
    expected = []
    for k, c in enumerate(chunks):
        lp = [-float(t) for t in c] if c is not None else None
        p = Piece(k, c, {}, {"seq": k}, [], None, lp)
        expected += one.push(p, is_last=k == len(chunks) - 1)
    cols = WindowState("a", size, overlap)
    got, k = [], 0
    while k < len(chunks):
        n = int(rng.integers(1, 13))
        part = run_piece(k, chunks[k : k + n])
        k += n
        got += cols.push_many([part], part.units, is_last=k >= len(chunks))

    def key(w):
        pieces = [(p.sequence, p.tokens, p.payload, p.units, p.logprobs) for p in w.pieces]
        return (
            w.index,
            w.start,
            w.overlap,
            w.is_last,
            w.units,
            w.tokens,
            w.logprobs,
            w.payloads,
            pieces,
        )

    assert [key(w) for w in got] == [key(w) for w in expected]
    assert len(got) >= 2 or size < 0


def test_a_run_cut_inside_one_segment_keeps_that_segments_middle():
    rp = run_piece(10, [[0, 1, 2], [3, 4, 5, 6], [7]])
    mid = rp.slice(4, 6)  # units 4 and 5: inside the second segment
    assert (mid.sequence, mid.tokens, mid.counts, mid.units) == (11, [[4, 5]], [2], 2)
    assert mid.logprobs == [[-4.0, -5.0]] and mid.payloads == [{"seq": 11}]
    across = rp.slice(2, 8)
    assert across.tokens == [[2], [3, 4, 5, 6], [7]] and across.sequence == 10
    assert rp.slice(0, 8) is rp
    assert run_piece(0, [[1, 2]], logprobs=False).slice(1, 2).logprobs is None
