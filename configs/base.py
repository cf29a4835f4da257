"""Defaults shared by every training config (ml_collections). Each config file's ``get_config``
starts from ``base_config()`` and overrides what differs; any field can be overridden on the
command line as ``--config.section.key=value``."""
import ml_collections


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.target = ""                       # HF directory or converted checkpoint of the frozen target
  c.output_dir = "runs/jetspec"       # checkpoints/, metrics.jsonl, TensorBoard events, head_hf/
  c.seed = 0

  c.head = ml_collections.ConfigDict()
  c.head.num_layers = 1
  c.head.block_size = 16
  c.head.causal = True
  c.head.target_layer_ids = ()        # empty: the published rule for num_layers
  c.head.mask_token_id = -1           # -1: the tokenizer's <|MASK|> if present, else vocab_size - 1
  c.head.intermediate_size = 0        # 0: the target's MLP width

  c.data = ml_collections.ConfigDict()
  c.data.source = "jsonl"             # jsonl | sharegpt
  c.data.path = ""                    # JSONL of {"messages": [...]} (e.g. `jetspec-jax regenerate` output)
  c.data.seq_len = 512
  c.data.pack = False                 # True: several conversations per row, each seen on its own
  c.data.enable_thinking = False
  c.data.eval_examples = 8            # held out for tau evaluation
  c.data.limit = 0                    # 0: all examples

  c.train = ml_collections.ConfigDict()
  c.train.steps = 1000
  c.train.batch_size = 8              # global sequences per optimizer micro-step
  c.train.grad_accum = 1
  c.train.learning_rate = 3e-4
  c.train.warmup_frac = 0.04
  c.train.final_lr_frac = 0.0
  c.train.weight_decay = 0.0
  c.train.clip_norm = 1.0
  c.train.num_anchors = 512
  c.train.loss = "kl"                 # kl | ce
  c.train.temperature = 1.0           # KD temperature (kl)
  c.train.gamma = 0.0                 # > 0: DFlash slot weighting exp(-(k-1)/gamma)
  c.train.chunk_anchors = 64          # anchors per chunk: head blocks + logits (step memory grows with it)
  c.train.compute_dtype = "bfloat16"  # head/target compute; optimizer state and master weights float32
  c.train.target_dtype = "bfloat16"

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1                    # -1: all devices not used by model
  c.mesh.model = 1
  c.mesh.expert_parallel = False      # MoE target: whole experts split over model (else each expert's MLP width)

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 500
  c.checkpoint.keep = 3

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 500                  # 0: only at the end
  c.eval.max_new_tokens = 64
  c.eval.tree = "accum_logp"          # any tree method (decode.tree.TREE_METHODS)
  c.eval.budget = 16
  c.eval.width = 4
  c.eval.tree_profile = ""            # acceptance profile for rank_caps / calibrated / static ("" = none)
  c.eval.online = "off"               # calibrated trees: off | batch | sequence

  c.log_every = 10
  c.export_dtype = "bfloat16"
  return c


def scale_schedule(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The schedule of the multi-GPU configs (Qwen3-8B, Qwen3-30B-A3B): sequences of 3072 tokens (the public
  DFlash recipe), 512 anchors per sequence in chunks of 32, a global batch of 32 sequences x 2 accumulation
  steps, 60k steps, a checkpoint every 1000 steps and an evaluation every 2000."""
  c.data.seq_len = 3072
  c.train.steps = 60000
  c.train.batch_size = 32
  c.train.grad_accum = 2
  c.train.num_anchors = 512
  c.train.chunk_anchors = 32
  c.checkpoint.every = 1000
  c.eval.every = 2000
  return c
