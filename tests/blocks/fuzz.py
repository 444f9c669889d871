#!/usr/bin/env python3
"""Long random run of the VSWA block manager (the driver in ``fuzz_driver.py`` beside this file).

Every operation is followed by the manager's invariant checks and byte checks of every live
row and cached block; a failure prints the seed, the episode and the last operations, and
``--episode`` replays that episode alone.

Usage: python tests/blocks/fuzz.py --ops 100000 --seed 1 [--episode N] [--progress]
"""

from __future__ import annotations

import argparse
import sys
import time

from fuzz_driver import FuzzFailure, run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=100_000, help="operations to run in total")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--episode", type=int, help="replay only this episode of the seed")
    parser.add_argument("--progress", action="store_true", help="a line per episode")
    args = parser.parse_args()
    start = time.perf_counter()
    try:
        stats = run(args.ops, args.seed, episode=args.episode, progress=args.progress)
    except FuzzFailure as exc:
        print(f"FAILED after {time.perf_counter() - start:.1f} s\n{exc}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    print(
        f"ok: {stats.ops} operations in {stats.episodes} episodes, seed {args.seed}, "
        f"{seconds:.1f} s ({stats.ops / seconds:.0f} ops/s)"
    )
    print(
        f"adds {stats.adds} (hits {stats.hits}, {stats.hit_tokens} tokens), extends "
        f"{stats.extends}, forks {stats.forks}, grows {stats.grows}, removes {stats.removes}, "
        f"lookups {stats.lookups}, "
        f"preemptions "
        f"{stats.preemptions}"
    )
    print(f"refused: {dict(stats.refused)}")
    print(f"manager: {dict(stats.manager)}")
    print(f"checked: {stats.rows_checked} live rows, {stats.cached_checked} cached blocks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
