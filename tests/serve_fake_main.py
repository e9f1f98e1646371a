"""TEMPORARY (until the real engine lands): `zerospeed serve` with FakeEngine, same flags."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve_cases import FakeEngine  # noqa: E402
from zerospeed.inference.serving.cli import build_parser, run_server  # noqa: E402

args = build_parser().parse_args(sys.argv[1:])
kw = {}
if args.num_blocks: kw["num_blocks"] = args.num_blocks
if args.block_size: kw["block_size"] = args.block_size
if args.max_num_seqs: kw["max_num_seqs"] = args.max_num_seqs
if args.max_model_len: kw["max_model_len"] = args.max_model_len
sys.exit(run_server(args, engine=FakeEngine(Path(args.model_dir), **kw)))
