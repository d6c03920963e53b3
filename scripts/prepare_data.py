"""Tokenize a corpus into a Megatron-Core dataset (corpus.bin/.idx, tokenizer.json, meta.json).

    # the default: the interpreter's standard library (offline, PSF licence), byte-level BPE, vocab 4096
    python scripts/prepare_data.py
    # your own text: .jsonl (one JSON object per line, text under --json-key) or .txt/.py (one document per file)
    python scripts/prepare_data.py --inputs my_corpus.jsonl notes/ --out data/mine --vocab-size 8192
    # no tokenizer training at all: raw UTF-8 bytes, vocab 257
    python scripts/prepare_data.py --tokenizer bytes --out data/stdlib-bytes

Running it again with the same inputs and settings reuses the dataset, unless it is damaged (then, or with
--rebuild, it is prepared again). See docs/data.md.
"""

import json
import logging
import sys
import time

from fp8_recipes.megatron.data import prepare_dataset
from fp8_recipes.training.config import check_writable_dir


def main(argv: list[str] | None = None) -> int:
    from fp8_recipes.checks import OneLineArgumentParser  # (one error line for a usage error)

    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", nargs="+", default=None,
                        help="files or directories (.jsonl, .txt, .py, ...); default: the Python standard library")
    parser.add_argument("--out", default="data/stdlib", help="dataset directory to write (default: data/stdlib)")
    parser.add_argument("--tokenizer", choices=("bpe", "bytes"), default="bpe", help="default: bpe")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default: 4096)")
    parser.add_argument("--json-key", default="text", help="field holding the text in .jsonl lines (default: text)")
    parser.add_argument("--rebuild", action="store_true", help="prepare it again even when --out holds this data "
                        "(damage only reading it finds; other damage is seen and rebuilt without it)")
    args = parser.parse_args(argv)
    from fp8_recipes.training.errors import ConsoleFormatter  # (a damaged dataset's warning: `warning: ...`)

    console = logging.StreamHandler()
    console.setFormatter(ConsoleFormatter("%(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[console])

    start = time.perf_counter()
    try:
        check_writable_dir("--out", args.out)
        out = prepare_dataset(args.inputs, args.out, args.tokenizer, args.vocab_size, args.json_key, args.rebuild)
    except ValueError as err:  # a user error: one line, no traceback
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    meta = json.loads((out / "meta.json").read_text())
    print(f"{out}: {meta['num_documents']} documents, {meta['num_tokens']} tokens, vocab {meta['vocab_size']} "
          f"({meta['tokenizer']['kind']}), {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
