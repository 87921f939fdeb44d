"""Summarise a py-spy profile of bench/member_cpu.py (``py-spy record --format raw``: one
collapsed stack and its sample count a line) into JSON: samples per phase of the benchmark
(the member_cpu.py function a stack sits under; the consumer thread's stacks under
``BaseConsumer.run``) and, within each phase, the samples that include each function of
interest (kafka-python's record parsing and its CRC32C check, validation, batch building,
duplicate keys, the engine).

    .venv/bin/python bench/experiments/member_cpu_pyspy.py RAW --command "..." --json PATH
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchinfo import git_commit, machine, write_result  # noqa: E402

PHASES = ("fetch", "old_path", "new_path", "engine_split")
FUNCTIONS = {
    "kafka-python poll (KafkaConsumer.poll)": "KafkaConsumer.poll",
    "kafka-python record parsing (_unpack_records)": "_unpack_records",
    "of which CRC32C (validate_crc)": "validate_crc",
    "of which _read_msg": "_read_msg",
    "validate_record": "validate_record",
    "EventBatch.of": "EventBatch.of",
    "key_of": "key_of",
    "decode_records": "decode_records",
    "of which keys_of": "keys_of",
    "sink hand-over (apply_batch)": "apply_batch",
    "Engine.apply": "Engine.apply",
}


def summarise(raw: Path) -> dict[str, object]:
    phases: Counter[str] = Counter()
    within: dict[str, Counter[str]] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = stack.split(";")
        names = [f.split(" (")[0] for f in frames]
        short = set(names) | {x.rsplit(".", 1)[-1] for x in names}
        phase = "other (imports, broker start)"
        for f in frames:
            m = re.match(r"(\w+) \(member_cpu\.py", f)
            if m and m.group(1) in PHASES:
                phase = m.group(1)
            if f.startswith("produce_stream "):
                phase = "produce"
        if "BaseConsumer.run" in names:
            phase = "consumer thread (BaseConsumer.run, old and new sinks)"
        phases[phase] += n
        counts = within.setdefault(phase, Counter())
        counts["all"] += n
        for label, fn in FUNCTIONS.items():
            if fn in short:
                counts[label] += n
    return {
        "samples": sum(phases.values()),
        "by_phase": dict(phases.most_common()),
        "within_phase": {p: dict(c.most_common()) for p, c in within.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("raw", type=Path)
    ap.add_argument("--command", required=True, help="the py-spy command that made RAW")
    ap.add_argument("--note", default="")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    result = {
        "benchmark": "member_cpu_pyspy",
        "machine": machine(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": args.command,
        "note": args.note,
        **summarise(args.raw),
    }
    write_result(args.json, result)


if __name__ == "__main__":
    main()
