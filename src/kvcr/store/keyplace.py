"""Filing records into the key table's entries: all of a batch at once, with numpy. Pure code.

Each record goes into the first free entry of its key's probe sequence, a window of entries
a round (:func:`place`); :func:`place_absent` skips the key comparisons for keys known
absent, and :func:`place_sorted` fills an empty table in one pass. Every placement writes
``entry`` (record -> its entry), so a removal writes its tombstone without probing.

Removal leaves a tombstone; insertion goes only into empty entries, so every key already in
the table lies before the first empty entry of its probe sequence and an insertion finds it
(a duplicate is reported, never filed twice).
"""

from __future__ import annotations

import numpy as np

from kvcr.store.keyprobe import EMPTY, STEPS, WINDOW, Layout, any_in_rows, matches
from kvcr.store.keyrows import U64_32


def place(
    lay: Layout,
    lens: np.ndarray,
    entry: np.ndarray,
    recs: np.ndarray,
    hashes: np.ndarray,
    span: int | None = None,
) -> tuple[np.ndarray, int]:
    """Put each record into the first free entry (a tombstone or empty) of its probe
    sequence, all at once, a window of entries a round, once the sequence up to its first
    empty entry holds no record of its key; a record whose key is met on the way is not
    placed. Returns (the record met, else -1; how many empty entries were used): reusing
    tombstones keeps a table under steady churn from filling up with them, so it is
    rarely rebuilt. ``span``: how many words of a row its key spans at most (None: all)."""
    n = len(recs)
    holders = np.full(n, -1, dtype=np.intp)
    todo = np.arange(n)
    home = (hashes & np.uint64(lay.mask)).astype(np.intp)
    pos, tag = home.copy(), (hashes >> U64_32).astype(np.uint32)
    free = np.full(n, -1, dtype=np.intp)  # the first tombstone met in earlier windows
    slots, used = lay.slots, 0
    while len(todo):
        at = (pos[:, None] + STEPS) & lay.mask
        held = slots.take(at)
        mine = recs[todo]
        mine_words = lay.words.take(mine, axis=0)[:, :span]
        i, holder = matches(lay, lens, at, held, tag, mine_words, lens.take(mine))
        holders[todo[i]] = holder
        done = np.zeros(len(todo), dtype=bool)
        done[i] = True
        open_ = held < 0  # EMPTY or TOMB
        first = np.where(
            any_in_rows(open_),
            np.take_along_axis(at, open_.argmax(axis=1)[:, None], 1)[:, 0],
            -1,
        )
        free = np.where(free < 0, first, free)
        # Only a window with an empty entry ends the search for the key.
        ends = any_in_rows(held == EMPTY) & ~done
        k = np.flatnonzero(ends)
        target = free[k]
        # A tombstone found in an earlier window may have been taken since.
        held_now = slots[target]
        taken = k[held_now >= 0]
        k, target, was_empty = k[held_now < 0], target[held_now < 0], held_now[held_now < 0]
        # Several may want one entry: each writes, one write stays, it won.
        slots[target] = mine[k]
        won = slots[target] == mine[k]
        lay.tags[target[won]] = tag[k[won]]
        entry[mine[k[won]]] = target[won]
        used += int((was_empty[won] == EMPTY).sum())
        done[k[won]] = True
        # A loser starts over from its home: the winner may hold its key, behind it.
        lost = np.concatenate([k[~won], taken])
        pos[lost], free[lost] = home[todo[lost]], -1
        step = ~ends & ~done
        pos = np.where(step, (pos + WINDOW) & lay.mask, pos)
        keep = ~done
        todo, pos, tag, free = todo[keep], pos[keep], tag[keep], free[keep]
    return holders, used


def place_absent(
    lay: Layout,
    entry: np.ndarray,
    recs: np.ndarray,
    hashes: np.ndarray,
    start: np.ndarray | None = None,
) -> int:
    """:func:`place` for distinct keys known absent: each into the first free entry
    (a tombstone or empty) of its probe sequence, as it is met; no key is compared, and
    the search ends there, not at the first empty entry. ``start``: where each key's
    search begins (None: its home; a later entry only if none before it is empty).
    Returns how many empty entries were used."""
    slots, mask = lay.slots, lay.mask
    pos = (hashes & np.uint64(mask)).astype(np.intp) if start is None else start
    tag = (hashes >> U64_32).astype(np.uint32)
    todo, used = recs, 0
    while len(todo):
        held = slots.take(pos[:, None] + STEPS, mode="wrap")
        open_ = held < 0  # EMPTY or TOMB
        k = np.flatnonzero(any_in_rows(open_))
        first = open_.argmax(axis=1).take(k)
        target = (pos.take(k) + first) & mask
        was = held[k, first]
        # Several may want one entry: each writes, one write stays, it won.
        mine = todo.take(k)
        slots[target] = mine
        won = slots[target] == mine
        lay.tags[target[won]] = tag.take(k)[won]
        entry[mine[won]] = target[won]
        used += int(np.count_nonzero(was[won] == EMPTY))
        # A loser reads its window again (the entry it lost is taken now); a key whose
        # window had no free entry reads the next one.
        going = np.ones(len(todo), dtype=bool)
        going[k[won]] = False
        stepping = np.ones(len(todo), dtype=bool)
        stepping[k] = False
        pos = np.where(stepping, (pos + WINDOW) & mask, pos)
        todo, pos, tag = todo[going], pos[going], tag[going]
    return used


def place_sorted(
    lay: Layout, lens: np.ndarray, entry: np.ndarray, recs: np.ndarray, hashes: np.ndarray
) -> np.ndarray:
    """:func:`place` into an empty table, in one pass: sorted by home entry, each goes
    to the later of its home and the entry after the previous one (what linear probing
    gives). The sort key is (home, tag), so equal keys end up side by side."""
    order_key = ((hashes & np.uint64(lay.mask)) << U64_32) | (hashes >> U64_32)
    order = np.argsort(order_key)
    ordered = order_key[order]
    twins = np.flatnonzero(ordered[1:] == ordered[:-1]) + 1
    if len(twins):
        r, prev = recs[order[twins]], recs[order[twins - 1]]
        same = (lens[r] == lens[prev]) & (lay.words[r] == lay.words[prev]).all(1)
        if same.any():  # a caller's duplicate (rare): one probe sequence at a time
            return place(lay, lens, entry, recs, hashes)[0]
    homes = (ordered >> U64_32).astype(np.intp)
    steps = np.arange(len(order))
    at = np.maximum.accumulate(homes - steps) + steps
    inside = at <= lay.mask
    if inside.all():
        lay.slots[at] = recs[order]
        lay.tags[at] = ordered.astype(np.uint32)
        entry[recs[order]] = at
        return np.full(len(recs), -1, dtype=np.intp)
    lay.slots[at[inside]] = recs[order[inside]]
    lay.tags[at[inside]] = ordered[inside].astype(np.uint32)
    entry[recs[order[inside]]] = at[inside]
    holders = np.full(len(recs), -1, dtype=np.intp)
    wrapped = order[~inside]  # past the end of the table: round to its start
    holders[wrapped] = place(lay, lens, entry, recs[wrapped], hashes[wrapped])[0]
    return holders
