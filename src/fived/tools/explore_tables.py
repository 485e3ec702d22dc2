"""The explore page's tables: what its entries refer to by index, each value stored once (reasons,
flag words, collective rows, layer-map and timeline keys), as a worker packs its message
(`MessageTables`) and as the page holds them after the messages' merge (`EntryTables`); `entry_of`
reads an entry back as the page's script does. `fived.tools.explore` computes what goes in them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from fived.layout.layout import Layout
from fived.planner.layout_cache import layout_values

# a valid entry as the page stores it: an array of these fields' values, in this order (the names once,
# in the data's `entry_fields`, not in each of a page's ~10^5 entries); `entry_of` (and the page's
# script, `entryAt`) turns one back into `price`'s figures. Memory is in bytes (an integer: fewer
# digits than its GiB, and GiB * 2**30 / 2**30 is the same double); `map` and `timeline` are indices
# into `map_keys` (one table per MAP_PARTS) and `timeline_keys`.
ENTRY_FIELDS = (
    "memory_bytes",
    "time",
    "tokens_per_s_per_gpu",
    "mfu",
    "fits",
    "flags",
    "describe",
    "microbatches",
    "bubble",
    "collectives",
    "map",
    "timeline",
)
MAP_PARTS = ("weights", "activations", "ranks")  # the layer map's parts, in `map_keys`' order

# where an ENTRY_FIELDS array holds what is stored by index
_FLAGS, _COLLECTIVES, _MAP, _TIMELINE = (ENTRY_FIELDS.index(f) for f in ("flags", "collectives", "map", "timeline"))


class Message(NamedTuple):
    """What `priced_mesh` sends with its entries: the values they refer to by index, each once."""

    reasons: list[str]
    words: list[str]  # flag words ("--parallel.tp 4")
    flag_sets: list[tuple[int, ...]]  # an entry's flags: indices into words
    rows: list[tuple]  # collective rows (`collectives`)
    row_sets: list[tuple[int, ...]]  # an entry's collectives: indices into rows
    map_sets: list[tuple[int, ...]]  # an entry's layer-map keys: per MAP_PARTS, an index into keys[part]
    keys: list[list[str]]  # per MAP_PARTS, then the timeline: its keys
    first: list[list[tuple]]  # per keys' part and key: (its first layout's field values, micro-batches)


class MessageTables:
    """The tables of one `priced_mesh` message, as its entries are packed."""

    def __init__(self) -> None:
        self.reasons, self.words, self.flag_sets = Interned(), Interned(), Interned()
        self.rows, self.row_sets, self.map_sets = Interned(), Interned(), Interned()
        self.keys = tuple(Interned() for _ in (*MAP_PARTS, "timeline"))
        self.first: list[list[tuple]] = [[] for _ in self.keys]
        self.seen_rows: dict[int, tuple[tuple, int]] = {}  # id(row) -> (the row, its index in rows): `row_index`

    def packed(self, entry: dict, layout: Layout) -> list:
        """`price`'s entry as an ENTRY_FIELDS array, what repeats as indices into these tables."""
        entry["memory_bytes"] = [_bytes(gib) for gib in entry["memory"]]
        entry["flags"] = self.flag_sets.id(tuple(self.words.id(pair) for pair in entry["flags"]))
        entry["collectives"] = self.row_sets.id(tuple(self.row_index(row) for row in entry["collectives"]))
        keys = (*entry["map"], entry["timeline"])
        ids = tuple(self._key_id(part, key, layout, entry["microbatches"]) for part, key in enumerate(keys))
        entry["map"], entry["timeline"] = self.map_sets.id(ids[:-1]), ids[-1]
        return [entry[name] for name in ENTRY_FIELDS]

    def _key_id(self, part: int, key: str, layout: Layout, micro: int) -> int:
        keys = self.keys[part]
        found = keys.index.get(key)
        if found is None:
            found = keys.id(key)
            self.first[part].append((layout_values(layout), micro))
        return found

    def row_index(self, row: tuple) -> int:
        """The index of a collective's row, found by the row object's identity where it was seen before
        (hashing a row's rank list for each of a page's 1.4M rows cost seconds). Sound because
        `seen_rows` holds every row object it saw: none dies while the message is built, so no other
        row can take its id (the memos that made a row may drop it meanwhile; `rows` keeps only the
        first of equal rows)."""
        found = self.seen_rows.get(id(row))
        if found is None:
            found = self.seen_rows[id(row)] = (row, self.rows.id(row))
        return found[1]

    def message(self) -> Message:
        return Message(
            self.reasons.items,
            self.words.items,
            self.flag_sets.items,
            self.rows.items,
            self.row_sets.items,
            self.map_sets.items,
            [keys.items for keys in self.keys],
            self.first,
        )


def _collective_tables(rows: list[tuple]) -> dict:
    """The page's `collectives` rows, each's rank list an index into `members` (rank lists repeat)."""
    members = Interned()
    table = [[*row[:6], members.id(row[6]), row[7]] for row in rows]
    return {"collectives": table, "members": [list(m) for m in members.items]}


class EntryTables:
    """The tables a page's entries refer to by index (values that repeat across entries, stored once:
    reasons, flag words, collective rows, layer-map and timeline keys), and the messages' merge."""

    def __init__(self) -> None:
        self.errors, self.flag_words, self.rows, self.timeline_keys = Interned(), Interned(), Interned(), Interned()
        self.map_keys = tuple(Interned() for _ in MAP_PARTS)

    def merge(self, message: Message, drawings: dict, draw: Callable[[str, tuple, int], Any]) -> tuple:
        """A message's values in these tables, each distinct one once: (per its reasons, the page's
        index; a function that turns one of its entries into the page's, in place). A key new to the
        page is drawn into `drawings` (per MAP_PARTS, then "timeline": key -> what the page draws:
        draw(part, the first layout's field values, its micro-batches)). Its entries share the lists
        of flag words, collective rows and map keys they refer to: read, never changed."""
        reasons = [self.errors.id(reason) for reason in message.reasons]
        words = [self.flag_words.id(word) for word in message.words]
        row_ids = [self.rows.id(row) for row in message.rows]
        key_ids = []
        for part, table, keys, firsts in zip(
            (*MAP_PARTS, "timeline"), (*self.map_keys, self.timeline_keys), message.keys, message.first
        ):
            key_ids.append([table.id(key) for key in keys])
            for key, (values, micro) in zip(keys, firsts):
                if key and key not in drawings[part]:  # ("": no timeline drawn)
                    drawings[part][key] = draw(part, values, micro)
        flags = [[words[i] for i in s] for s in message.flag_sets]
        rows = [[row_ids[i] for i in s] for s in message.row_sets]
        maps = [[key_ids[part][i] for part, i in enumerate(s)] for s in message.map_sets]
        timelines = key_ids[-1]

        def placed(entry: list) -> list:
            entry[_FLAGS], entry[_COLLECTIVES] = flags[entry[_FLAGS]], rows[entry[_COLLECTIVES]]
            entry[_MAP], entry[_TIMELINE] = maps[entry[_MAP]], timelines[entry[_TIMELINE]]
            return entry

        return reasons, placed

    def data(self) -> dict:
        """The tables, as the page's data names them (beside `entry_fields`, which `entry_of` reads)."""
        return {
            "entry_fields": ENTRY_FIELDS,
            "errors": self.errors.items,
            "flag_words": self.flag_words.items,
            **_collective_tables(self.rows.items),
            "map_keys": [keys.items for keys in self.map_keys],
            "timeline_keys": self.timeline_keys.items,
        }


def _bytes(gib: float) -> int | float:
    """GiB as bytes, exactly (a power of two's product): the integer where it is one (all the planner's
    are; 11 digits where the GiB took 17), so that bytes / 2**30, here or in the page, is `gib` again."""
    found = gib * 2**30
    return int(found) if found.is_integer() else found


def entry_of(data: dict, position: int) -> dict | int | None:
    """`explore_data`'s entry at `position` as the page's script reads it (pages.js `entryAt`): the
    figures `price` returned (memory in GiB, the map's and timeline's keys), a reason's index, or None."""
    stored = data["entries"][position]
    if not isinstance(stored, list):
        return stored
    entry = dict(zip(data["entry_fields"], stored))
    entry["memory"] = [b / 2**30 for b in entry.pop("memory_bytes")]
    entry["map"] = [keys[i] for keys, i in zip(data["map_keys"], entry["map"])]
    entry["timeline"] = data["timeline_keys"][entry["timeline"]]
    return entry


class Interned:
    """Values stored once, referred to by index."""

    def __init__(self):
        self.items: list = []
        self.index: dict = {}

    def id(self, value) -> int:
        found = self.index.get(value)
        if found is None:
            found = self.index[value] = len(self.items)
            self.items.append(value)
        return found
