#!/usr/bin/env python3
"""Reads a CPU profile in pprof's protobuf format (what the debug port's /debug/pprof/profile
serves) and prints where the samples were: the functions they stopped in (self) and the
functions on their stacks (inclusive), or, with --callers NAME, the stacks above the functions
whose name contains NAME. No dependency: the few fields of profile.proto it needs are decoded
here (go tool pprof reads the same file, where it is installed).

Usage: scripts/pprof_top.py PROFILE [--top N] [--callers NAME] [--only NAME]
"""

import argparse
import collections
import gzip
import sys


def varint(buf, i):
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def fields(buf):
    """Yields (field number, wire type, value) of one message; value is an int or bytes."""
    i = 0
    while i < len(buf):
        key, i = varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = varint(buf, i)
        elif wire == 2:
            n, i = varint(buf, i)
            value, i = buf[i : i + n], i + n
        elif wire == 1:
            value, i = int.from_bytes(buf[i : i + 8], "little"), i + 8
        elif wire == 5:
            value, i = int.from_bytes(buf[i : i + 4], "little"), i + 4
        else:
            raise ValueError(f"wire type {wire}")
        yield number, wire, value


def ints(wire, value):
    """A repeated integer field: packed (bytes) or one value."""
    if wire != 2:
        return [value]
    out, i = [], 0
    while i < len(value):
        v, i = varint(value, i)
        out.append(v)
    return out


def load(path):
    data = open(path, "rb").read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    strings, functions, locations, samples = [], {}, {}, []
    for number, wire, value in fields(data):
        if number == 2:  # Sample: location_id = 1, value = 2
            locs, values = [], []
            for n, w, v in fields(value):
                if n == 1:
                    locs += ints(w, v)
                elif n == 2:
                    values += ints(w, v)
            samples.append((locs, values[0] if values else 1))
        elif number == 4:  # Location: id = 1, line = 4 (Line: function_id = 1)
            ident, lines = 0, []
            for n, w, v in fields(value):
                if n == 1:
                    ident = v
                elif n == 4:
                    lines += [fv for fn, _, fv in fields(v) if fn == 1]
            locations[ident] = lines
        elif number == 5:  # Function: id = 1, name = 2
            ident = name = 0
            for n, w, v in fields(value):
                if n == 1:
                    ident = v
                elif n == 2:
                    name = v
            functions[ident] = name
        elif number == 6:
            strings.append(value.decode("utf-8", "replace"))
    stacks = []
    for locs, count in samples:
        names = [strings[functions[f]] for loc in locs for f in locations.get(loc, [])]
        stacks.append((names, count))
    return stacks


def short(name, width=150):
    return name if len(name) <= width else name[: width - 1] + "…"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--callers", help="the stacks above functions whose name contains this")
    p.add_argument("--only", help="only samples with a function whose name contains this")
    a = p.parse_args()
    stacks = load(a.profile)
    if a.only:
        stacks = [(s, c) for s, c in stacks if any(a.only in n for n in s)]
    total = sum(c for _, c in stacks)
    print(f"{total} samples")
    if total == 0:
        return 0
    if a.callers:
        chains = collections.Counter()
        for names, count in stacks:
            if names and a.callers in names[0]:
                chains[" <- ".join(short(n, 70) for n in names[1:6])] += count
        for chain, count in chains.most_common(a.top):
            print(f"{100 * count / total:5.1f}% {chain}")
        return 0
    own, inclusive = collections.Counter(), collections.Counter()
    for names, count in stacks:
        if names:
            own[names[0]] += count
        for name in set(names):
            inclusive[name] += count
    # The runtime's frames under every sample say nothing: inclusive lists the rest.
    inclusive = collections.Counter({n: c for n, c in inclusive.items() if c < 0.95 * total})
    for title, counter in (("self", own), ("inclusive (below 95%)", inclusive)):
        print(f"== {title}")
        for name, count in counter.most_common(a.top):
            print(f"{100 * count / total:5.1f}% {short(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
