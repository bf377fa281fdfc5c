"""Named, idempotent fixes of fairseq 0.12.2 for Python >= 3.11, torch >= 2.6 and the edges users meet.

fairseq 0.12.2 (2022) is the newest release on PyPI and is broken on today's stack (see
REFERENCE.md sections 1 and 8). Each fix below edits fairseq's source at the narrowest point
that removes one breakage, and says why it exists. The fixes go into the source of the 0.12.2
sdist, which ``scripts/build_fairseq_wheel.py`` builds into a local wheel whose version carries
a label naming this set of fixes (``0.12.2+plugins.<hash>``); ``scripts/setup.sh`` installs it
with pip. An installed fairseq is never edited in place: ``check`` only reads it.

Edits are plain text replacements: a fix is "applied" when its new text is in place, "missing"
when the original text is found once, and anything else means a fairseq source we do not know,
which we refuse to touch.

    python -m fairseq_plugins.fairseq_fixes check            # the installed fairseq; exit 1 if a fix is missing
    python -m fairseq_plugins.fairseq_fixes apply SDIST_DIR  # fix an unpacked sdist; safe to repeat
    python -m fairseq_plugins.fairseq_fixes version          # the version a build with these fixes carries

This module must not import fairseq: without the fixes, ``import fairseq`` raises.
"""

import hashlib
import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .command_line import CommandError, command_parser
from .resources import setup_command

SUPPORTED_FAIRSEQ_VERSION = "0.12.2"

APPLIED, MISSING = "applied", "missing"


class FairseqFixError(CommandError, RuntimeError):
    """The installed fairseq is absent, of another version, or its sources are unknown."""


@dataclass(frozen=True)
class TextEdit:
    """Replace ``old`` by ``new`` in one file, named relative to the root of a fairseq tree."""

    path: str
    old: str
    new: str

    def __post_init__(self):
        # Status detection relies on the new text not containing the old one.
        assert self.old not in self.new, self


@dataclass(frozen=True)
class Fix:
    """One breakage and its edits of the sdist; ``installed`` says how it shows once built and
    installed, when that is not the same text (the metadata pip reads)."""

    name: str
    why: str
    edits: Tuple[TextEdit, ...]
    installed: Optional[Tuple[TextEdit, ...]] = None


class SourceTree:
    """An unpacked fairseq sdist: ``fairseq/``, ``fairseq_cli/``, ``setup.py``."""

    def __init__(self, root):
        self.root = Path(root)

    def file(self, path: str) -> Path:
        return self.root / path

    def version(self) -> str:
        return self.file("fairseq/version.txt").read_text().strip()

    def edits(self, fix: Fix) -> Tuple[TextEdit, ...]:
        return fix.edits

    def __str__(self):
        return str(self.root)


class InstalledTree:
    """The fairseq that Python imports: its packages and its .dist-info (found without importing it)."""

    def file(self, path: str) -> Path:
        if path == "METADATA":
            return _installed_metadata_file()
        return fairseq_package_dir().parent / path

    def version(self) -> str:
        return installed_fairseq_version()

    def edits(self, fix: Fix) -> Tuple[TextEdit, ...]:
        return fix.installed or fix.edits

    def __str__(self):
        return str(fairseq_package_dir())


def _installed_metadata_file() -> Path:
    """The METADATA of the installed fairseq's .dist-info (what pip's resolver reads)."""
    dist = importlib.metadata.distribution("fairseq")
    return Path(dist.locate_file(next(f for f in dist.files if f.name == "METADATA" and "dist-info" in str(f))))


def fairseq_package_dir() -> Path:
    """The installed fairseq package folder, found without importing it."""
    spec = importlib.util.find_spec("fairseq")
    if spec is None or not spec.submodule_search_locations:
        raise FairseqFixError(f"fairseq is not installed; run {setup_command()} (it installs the fixed fairseq 0.12.2)")
    return Path(list(spec.submodule_search_locations)[0])


def installed_fairseq_version() -> str:
    try:
        return importlib.metadata.version("fairseq")
    except importlib.metadata.PackageNotFoundError as e:
        raise FairseqFixError(
            f"fairseq is not installed; run {setup_command()} (it installs the fixed fairseq 0.12.2)"
        ) from e


def _dataclass_default_edits(path: str, fields: List[Tuple[str, str]]) -> Tuple[TextEdit, ...]:
    return tuple(
        TextEdit(path, f"{name}: {typ} = {typ}()", f"{name}: {typ} = field(default_factory={typ})")
        for name, typ in fields
    )


_DIST = "fairseq/distributed/utils.py"

FIXES = (
    Fix(
        name="dataclass_defaults",
        why=(
            "Python 3.11 rejects dataclass fields whose default is an unhashable instance "
            "(another dataclass); `import fairseq` raises ValueError. Use default_factory."
        ),
        edits=_dataclass_default_edits(
            "fairseq/dataclass/configs.py",
            [
                ("common", "CommonConfig"),
                ("common_eval", "CommonEvalConfig"),
                ("distributed_training", "DistributedTrainingConfig"),
                ("dataset", "DatasetConfig"),
                ("optimization", "OptimizationConfig"),
                ("checkpoint", "CheckpointConfig"),
                ("bmuf", "FairseqBMUFConfig"),
                ("generation", "GenerationConfig"),
                ("eval_lm", "EvalLMConfig"),
                ("interactive", "InteractiveConfig"),
                ("ema", "EMAConfig"),
            ],
        )
        + _dataclass_default_edits(
            "fairseq/models/transformer/transformer_config.py",
            [("encoder", "EncDecBaseConfig"), ("decoder", "DecoderConfig")],
        )
        + (
            TextEdit(
                "fairseq/models/transformer/transformer_config.py",
                "quant_noise: QuantNoiseConfig = field(default=QuantNoiseConfig())",
                "quant_noise: QuantNoiseConfig = field(default_factory=QuantNoiseConfig)",
            ),
        ),
    ),
    Fix(
        name="hydra_init_default_factory",
        why=(
            "hydra_init registers each FairseqConfig group from `field.default`, which is "
            "MISSING once the groups use default_factory; build the default instead."
        ),
        edits=(
            TextEdit(
                "fairseq/dataclass/initialize.py",
                "v = FairseqConfig.__dataclass_fields__[k].default\n",
                "fld = FairseqConfig.__dataclass_fields__[k]\n"
                "        v = fld.default_factory() if callable(fld.default_factory) else fld.default\n",
            ),
        ),
    ),
    Fix(
        name="torch_load_weights_only",
        why=(
            "torch >= 2.6 loads with weights_only=True by default, which refuses the "
            "argparse.Namespace and config objects fairseq checkpoints hold; fairseq-generate "
            "and resuming training fail. Checkpoints are the user's own files: load them fully. "
            "While at that line, a file torch cannot read is reported as 'not a valid "
            "checkpoint' with its path, instead of a bare unpickling error."
        ),
        edits=(
            TextEdit(
                "fairseq/checkpoint_utils.py",
                '        state = torch.load(f, map_location=torch.device("cpu"))\n',
                "        try:\n"
                '            state = torch.load(f, map_location=torch.device("cpu"), weights_only=False)\n'
                "        except Exception as e:\n"
                '            raise RuntimeError(f"{path} is not a valid checkpoint: {e}") from e\n',
            ),
            TextEdit(
                "fairseq/checkpoint_utils.py",
                '"cpu")\n            ),\n        )',
                '"cpu")\n            ),\n            weights_only=False,\n        )',
            ),
        ),
    ),
    Fix(
        name="bettertransformer_fast_path",
        why=(
            "Loading a checkpoint turns on 0.12.2's BetterTransformer inference path, which "
            "calls torch._transformer_encoder_layer_fwd with a signature torch has since "
            "changed ('Mask Type should be defined'). Upstream removed the path; we never "
            "enable it, so layers always run their ordinary forward."
        ),
        edits=(
            TextEdit(
                "fairseq/modules/transformer_layer.py",
                "        self.load_to_BT = True\n",
                "        self.load_to_BT = False  # fairseq_plugins: fast path disabled\n",
            ),
        ),
    ),
    Fix(
        name="dependency_pins",
        why=(
            "fairseq's metadata requires torchaudio (pip then installs a torchaudio built for "
            "another torch, whose import raises OSError, or a second torch) and pins "
            "hydra-core<1.1 / omegaconf<2.1, which fail on Python 3.11. Translation never "
            "imports torchaudio; hydra-core 1.3.2 and omegaconf 2.3.0 work once the fixes above "
            "are in. Declare the working set, so that `pip check` is clean and pip keeps it."
        ),
        edits=(
            TextEdit("setup.py", '            "torchaudio>=0.8.0",\n', ""),
            TextEdit(
                "setup.py",
                '            "hydra-core>=1.0.7,<1.1",\n            "omegaconf<2.1",\n',
                '            "hydra-core>=1.3.2",\n            "omegaconf>=2.3.0",\n',
            ),
        ),
        installed=(
            TextEdit("METADATA", "Requires-Dist: torchaudio>=0.8.0\n", ""),
            TextEdit("METADATA", "Requires-Dist: hydra-core<1.1,>=1.0.7\n", "Requires-Dist: hydra-core>=1.3.2\n"),
            TextEdit("METADATA", "Requires-Dist: omegaconf<2.1\n", "Requires-Dist: omegaconf>=2.3.0\n"),
        ),
    ),
    Fix(
        name="missing_user_dir_message",
        why=(
            "Without --user-dir, a plugin's model type is unknown and fairseq's message for it "
            "calls .format() on an f-string that already holds the config: braces in the config "
            "raise IndexError/KeyError and the model type is lost. Say which type is unknown "
            "and that a plugin needs --user-dir; the same for a plugin's task."
        ),
        edits=(
            TextEdit(
                "fairseq/models/__init__.py",
                "    assert model is not None, (\n"
                '        f"Could not infer model type from {cfg}. "\n'
                '        "Available models: {}".format(MODEL_DATACLASS_REGISTRY.keys())\n'
                '        + f" Requested model type: {model_type}"\n'
                "    )\n",
                "    if model is None:  # fairseq_plugins: a message that names the model type\n"
                "        raise ValueError(\n"
                '            f"unknown model type {model_type!r}: a model from a plugin needs the plugin\'s "\n'
                '            "folder, --user-dir PATH (user_dir=PATH for from_pretrained), e.g. "\n'
                '            "--user-dir path/to/fairseq_plugins. Known model types: "\n'
                '            + ", ".join(sorted(MODEL_REGISTRY))\n'
                "        )\n",
            ),
            TextEdit(
                "fairseq/tasks/__init__.py",
                "    assert (\n"
                "        task is not None\n"
                '    ), f"Could not infer task type from {cfg}. Available argparse tasks: '
                '{TASK_REGISTRY.keys()}. Available hydra tasks: {TASK_DATACLASS_REGISTRY.keys()}"\n',
                "    if task is None:  # fairseq_plugins: a message that names the task\n"
                "        raise ValueError(\n"
                '            f"unknown task {task_name!r}: a task from a plugin needs the plugin\'s folder, "\n'
                '            "--user-dir PATH (user_dir=PATH for from_pretrained). Known tasks: "\n'
                '            + ", ".join(sorted(TASK_REGISTRY))\n'
                "        )\n",
            ),
        ),
    ),
    Fix(
        name="torchrun_local_rank",
        why=(
            "Under torchrun, fairseq takes the device from LOCAL_RANK only as the default of "
            "device_id, read when fairseq is imported; a config that sets device_id (a hydra "
            "yaml, a saved config) leaves every process of a node on cuda:0. The launcher's "
            "LOCAL_RANK is the truth wherever torchrun's environment is recognised."
        ),
        edits=(
            TextEdit(
                _DIST,
                '    cfg.distributed_rank = int(os.environ["RANK"])\n    # processes are created by',
                '    cfg.distributed_rank = int(os.environ["RANK"])\n'
                '    if "LOCAL_RANK" in os.environ:  # fairseq_plugins: this process\'s device on its node\n'
                '        cfg.device_id = int(os.environ["LOCAL_RANK"])\n'
                "    # processes are created by",
            ),
        ),
    ),
    Fix(
        name="cpu_distributed_spawn",
        why=(
            "`--distributed-world-size N --cpu` counts CUDA devices to decide how many processes "
            "to spawn: 'world size is N but have 0 available devices'. On CPU, spawn one process "
            "per rank (with --distributed-backend gloo)."
        ),
        edits=(
            TextEdit(
                _DIST,
                "def infer_init_method(cfg: DistributedTrainingConfig, force_distributed=False):",
                "def infer_init_method(cfg: DistributedTrainingConfig, force_distributed=False, cpu=False):",
            ),
            TextEdit(_DIST, "        _infer_single_node_init(cfg)\n", "        _infer_single_node_init(cfg, cpu)\n"),
            TextEdit(
                _DIST,
                "                torch.cuda.device_count(), cfg.distributed_world_size\n",
                "                cfg.distributed_world_size if cpu else torch.cuda.device_count(),\n"
                "                cfg.distributed_world_size,\n",
            ),
            TextEdit(
                _DIST,
                "def _infer_single_node_init(cfg: DistributedTrainingConfig):\n"
                "    assert (\n        cfg.distributed_world_size <=",
                "def _infer_single_node_init(cfg: DistributedTrainingConfig, cpu=False):\n"
                "    assert (\n        cpu or cfg.distributed_world_size <=",
            ),
            TextEdit(
                _DIST,
                "        infer_init_method(cfg.distributed_training)\n",
                "        infer_init_method(cfg.distributed_training, cpu=cfg.common.cpu)\n",
            ),
            TextEdit(
                _DIST,
                "                nprocs=min(\n                    torch.cuda.device_count(),\n",
                "                nprocs=min(\n"
                "                    cfg.distributed_training.distributed_world_size\n"
                "                    if cfg.common.cpu  # fairseq_plugins: one CPU process per rank\n"
                "                    else torch.cuda.device_count(),\n",
            ),
        ),
    ),
    Fix(
        name="ddp_cpu_device_ids",
        why=(
            "`--ddp-backend c10d` wraps the model in DistributedDataParallel with "
            "device_ids=[device_id], which torch refuses for a module on CPU; only legacy_ddp "
            "trained on CPU. A CPU module takes no device ids."
        ),
        edits=(
            TextEdit(
                "fairseq/models/distributed_fairseq_model.py",
                "            device_ids=[args.device_id],\n            output_device=args.device_id,\n",
                "            # fairseq_plugins: a module on CPU takes no device ids\n"
                '            device_ids=None if torch.device(device).type == "cpu" else [args.device_id],\n'
                '            output_device=None if torch.device(device).type == "cpu" else args.device_id,\n',
            ),
        ),
    ),
    Fix(
        name="ddp_unused_fast_path_weights",
        why=(
            "Every encoder layer keeps copies of its weights for the BetterTransformer path "
            "(in_proj_weight, fc1_weight, ...), which never get a gradient; DistributedDataParallel "
            "(--ddp-backend c10d, the default) stops in the second update ('Expected to have "
            "finished reduction in the prior iteration'), for the stock transformer too. Tell DDP "
            "to ignore exactly those copies; checkpoints and optimizer states keep their layout."
        ),
        edits=(
            TextEdit(
                "fairseq/models/distributed_fairseq_model.py",
                '    elif args.ddp_backend in {"c10d", "pytorch_ddp"}:\n'
                "        wrapped_model = DistributedDataParallel(\n",
                '    elif args.ddp_backend in {"c10d", "pytorch_ddp"}:\n'
                "        # fairseq_plugins: the encoder layers' weight copies for the (disabled)\n"
                "        # BetterTransformer path never get a gradient; DDP must not wait for them\n"
                "        from fairseq.modules.transformer_layer import TransformerEncoderLayerBase\n"
                "\n"
                "        copies = (\"in_proj_weight\", \"in_proj_bias\", \"out_proj_weight\", \"out_proj_bias\",\n"
                "                  \"fc1_weight\", \"fc1_bias\", \"fc2_weight\", \"fc2_bias\")\n"
                "        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [\n"
                "            f\"{name}.{copy}\" for name, layer in model.named_modules()\n"
                "            if isinstance(layer, TransformerEncoderLayerBase) for copy in copies\n"
                "        ])\n"
                "        wrapped_model = DistributedDataParallel(\n",
            ),
        ),
    ),
    Fix(
        name="half_precision_flags",
        why=(
            "In fairseq 0.12.2 --bf16 (and --memory-efficient-bf16) imply --tpu: without torch_xla "
            "they die in the XLA path ('NoneType' object has no attribute 'xla_device'), on CPU "
            "and GPU alike. On CPU, --fp16 dies deep in torch's CUDA code, while "
            "--memory-efficient-fp16 trains slowly in float16 and --amp does nothing. Say so "
            "when the trainer picks its device, before any training step: errors for the first "
            "two, warnings for the others."
        ),
        edits=(
            TextEdit(
                "fairseq/trainer.py",
                "        self.cuda = torch.cuda.is_available() and not cfg.common.cpu and not self.tpu\n"
                "        if self.cuda:\n",
                "        self.cuda = torch.cuda.is_available() and not cfg.common.cpu and not self.tpu\n"
                "        # fairseq_plugins: what half precision cannot do here, said before training\n"
                "        if self.tpu and utils.xm is None:\n"
                "            raise ValueError(\n"
                '                "--tpu, which --bf16 and --memory-efficient-bf16 imply in fairseq 0.12.2, needs "\n'
                '                "torch_xla (TPUs); drop the flag to train in float32 (or --fp16 on a GPU)"\n'
                "            )\n"
                "        if not self.cuda and not self.tpu:\n"
                "            if cfg.common.fp16 and not cfg.common.memory_efficient_fp16:\n"
                '                raise ValueError("--fp16 needs a CUDA GPU; on CPU, train in float32: drop the flag")\n'
                "            if cfg.common.memory_efficient_fp16:\n"
                '                logger.warning("--memory-efficient-fp16 on CPU trains in float16, which is slow "\n'
                '                               "there; float32 (no flag) is the faster choice")\n'
                "            if cfg.common.amp:\n"
                '                logger.warning("--amp does nothing on CPU: training runs in float32")\n'
                "        if self.cuda:\n",
            ),
        ),
    ),
    Fix(
        name="tensorboardx_import_message",
        why=(
            "`import fairseq` imports the text_to_speech task, which looks only for tensorboardX and "
            "logs 'Please install tensorboardX' on every command, although torch's own writer (what "
            "the progress bar uses for --tensorboard-logdir) is installed. Take torch's writer first, "
            "as the progress bar does, and say nothing at import: the progress bar already warns "
            "when --tensorboard-logdir is given and no writer is installed."
        ),
        edits=(
            TextEdit(
                "fairseq/tasks/text_to_speech.py",
                "try:\n"
                "    from tensorboardX import SummaryWriter\n"
                "except ImportError:\n"
                '    logger.info("Please install tensorboardX: pip install tensorboardX")\n'
                "    SummaryWriter = None\n",
                "try:  # fairseq_plugins: torch's writer first, as fairseq/logging/progress_bar.py\n"
                "    from torch.utils.tensorboard import SummaryWriter\n"
                "except ImportError:\n"
                "    try:\n"
                "        from tensorboardX import SummaryWriter\n"
                "    except ImportError:\n"
                "        SummaryWriter = None\n",
            ),
        ),
    ),
    Fix(
        name="hydra_deprecated_api",
        why=(
            "fairseq composes its config with hydra 1.0's API (hydra.experimental, compose(strict=), "
            "no version_base, a '# @package _group_' header); hydra 1.3 prints five deprecation "
            "warnings on every command, and fairseq-hydra-train's @hydra.main one more; hydra >= 1.3.5 "
            "also warns on version_base 1.1, whose behaviour hydra 1.4 removes. Use the stable API with "
            "version_base 1.3, keep the one 1.1 behaviour fairseq's configs rely on (fairseq-hydra-train "
            "runs in hydra.run.dir: hydra.job.chdir=True unless the command line sets it) and unset "
            "struct mode as strict=False did: the same config, no warnings."
        ),
        edits=(
            TextEdit(
                "fairseq/dataclass/utils.py",
                "from hydra.experimental import compose, initialize\n",
                "from hydra import compose, initialize\n",
            ),
            TextEdit(
                "fairseq/dataclass/utils.py",
                "    with initialize(config_path=config_path):\n"
                "        try:\n"
                '            composed_cfg = compose("config", overrides=overrides, strict=False)\n',
                "    with initialize(config_path=config_path, version_base=\"1.3\"):\n"
                "        try:\n"
                '            composed_cfg = compose("config", overrides=overrides)\n'
                "            OmegaConf.set_struct(composed_cfg, False)  # fairseq_plugins: was strict=False\n",
            ),
            TextEdit("fairseq/config/config.yaml", "# @package _group_\n\n", ""),
            TextEdit(
                "fairseq_cli/hydra_train.py",
                '@hydra.main(config_path=os.path.join("..", "fairseq", "config"), config_name="config")\n',
                '@hydra.main(config_path=os.path.join("..", "fairseq", "config"), config_name="config", '
                'version_base="1.3")\n',
            ),
            TextEdit("fairseq_cli/hydra_train.py", "import logging\nimport os\n\n",
                     "import logging\nimport os\nimport sys\n\n"),
            TextEdit(
                "fairseq_cli/hydra_train.py",
                "    hydra_init(cfg_name)\n    hydra_main()\n",
                "    hydra_init(cfg_name)\n"
                '    if not any(arg.lstrip("+").startswith("hydra.job.chdir=") for arg in sys.argv[1:]):\n'
                "        # fairseq_plugins: hydra 1.1's default, which fairseq's configs assume\n"
                '        sys.argv.append("hydra.job.chdir=True")\n'
                "    hydra_main()\n",
            ),
        ),
    ),
    Fix(
        name="torch_amp_autocast",
        why=(
            "Every training step enters torch.cuda.amp.autocast(...), which torch >= 2.4 deprecates "
            "with a FutureWarning; torch.autocast('cuda', ...) is the same context."
        ),
        edits=(
            TextEdit(
                "fairseq/tasks/fairseq_task.py",
                "            with torch.cuda.amp.autocast(enabled=(isinstance(optimizer, AMPOptimizer))):\n",
                '            with torch.autocast("cuda", enabled=(isinstance(optimizer, AMPOptimizer))):\n',
            ),
        ),
    ),
    Fix(
        name="mha_padding_mask_dtype",
        why=(
            "A decoder's self-attention in training passes torch a bool padding mask beside the float "
            "future mask; torch deprecates the mix ('Support for mismatched key_padding_mask and "
            "attn_mask is deprecated') and warns on every command that trains the stock decoder. "
            "Hand torch the float mask it makes of the bool one itself (-inf where padded)."
        ),
        edits=(
            TextEdit(
                "fairseq/modules/multihead_attention.py",
                "            else:\n"
                "                return F.multi_head_attention_forward(\n",
                "            else:\n"
                "                # fairseq_plugins: a float padding mask beside a float attn_mask, as torch\n"
                "                # would make it (-inf where padded); torch deprecates the bool/float mix\n"
                "                if (\n"
                "                    key_padding_mask is not None\n"
                "                    and attn_mask is not None\n"
                "                    and key_padding_mask.dtype == torch.bool\n"
                "                    and attn_mask.is_floating_point()\n"
                "                ):\n"
                "                    key_padding_mask = torch.zeros_like(\n"
                "                        key_padding_mask, dtype=attn_mask.dtype\n"
                '                    ).masked_fill_(key_padding_mask, float("-inf"))\n'
                "                return F.multi_head_attention_forward(\n",
            ),
        ),
    ),
    Fix(
        name="cpu_distributed_gloo",
        why=(
            "`--cpu` with several processes (--distributed-world-size N, torchrun) keeps the "
            "default backend, NCCL, which needs GPUs: a 71-line traceback ending in 'Distributed "
            "package doesn't have NCCL built in'. On CPU, pick gloo and say so."
        ),
        edits=(
            TextEdit(
                _DIST,
                "def call_main(cfg: FairseqConfig, main, **kwargs):\n"
                "    if cfg.distributed_training.distributed_init_method is None:\n",
                "def call_main(cfg: FairseqConfig, main, **kwargs):\n"
                "    # fairseq_plugins: NCCL needs GPUs; CPU processes talk through gloo\n"
                '    if cfg.common.cpu and cfg.distributed_training.distributed_backend == "nccl":\n'
                '        cfg.distributed_training.distributed_backend = "gloo"\n'
                '        if cfg.distributed_training.distributed_world_size > 1 or "WORLD_SIZE" in os.environ:\n'
                '            logger.info("--cpu: distributed backend gloo (NCCL needs GPUs)")\n'
                "    if cfg.distributed_training.distributed_init_method is None:\n",
            ),
        ),
    ),
    Fix(
        name="decode_half_precision",
        why=(
            "fairseq-generate and fairseq-interactive on CPU run --fp16 in float16 without a word "
            "(slow there, and not what training allows), and ignore --bf16 everywhere (0.12.2 "
            "decodes bfloat16 nowhere). Refuse both before loading the model, as training does."
        ),
        edits=tuple(
            TextEdit(
                path,
                "    use_cuda = torch.cuda.is_available() and not cfg.common.cpu\n\n",
                "    use_cuda = torch.cuda.is_available() and not cfg.common.cpu\n"
                "    # fairseq_plugins: half precision that cannot be honoured here is refused\n"
                "    if cfg.common.fp16 and not use_cuda:\n"
                '        raise ValueError("--fp16 needs a CUDA GPU; on CPU, decode in float32: drop the flag")\n'
                "    if cfg.common.bf16:\n"
                '        raise ValueError("--bf16: fairseq 0.12.2 does not decode in bfloat16 (the flag would be "\n'
                '                         "ignored); drop it, or use --fp16 on a GPU")\n\n',
            )
            for path in ("fairseq_cli/generate.py", "fairseq_cli/interactive.py")
        ),
    ),
    Fix(
        name="hub_task_encoders",
        why=(
            "fairseq-interactive builds its tokenizer and BPE through the task "
            "(task.build_tokenizer/build_bpe), so a task can protect its own markup (the document "
            "task's sentence separator <s>); the hub interface builds them directly and so "
            "tokenizes such input differently. Build them through the task, as the CLIs do."
        ),
        edits=(
            TextEdit(
                "fairseq/hub_utils.py",
                "        self.tokenizer = encoders.build_tokenizer(cfg.tokenizer)\n"
                "        self.bpe = encoders.build_bpe(cfg.bpe)\n",
                "        # fairseq_plugins: through the task, as fairseq-interactive does\n"
                "        self.tokenizer = task.build_tokenizer(cfg.tokenizer)\n"
                "        self.bpe = task.build_bpe(cfg.bpe)\n",
            ),
        ),
    ),
    Fix(
        name="user_dir_imported_before",
        why=(
            "from_pretrained(..., user_dir=PATH) after `from plugin.models.x import XModel` finds "
            "the plugin package already imported and skips importing its tasks/ and models/ "
            "folders, so a task of the plugin is unknown ('unknown task ... user_dir=PATH') although "
            "user_dir was given. Import those folders in that case too (importing twice is a no-op)."
        ),
        edits=(
            TextEdit(
                "fairseq/utils.py",
                "            elif module_path in sys.modules[module_name].__path__:\n"
                '                logger.info(f"--user-dir={module_path} has already been imported.")\n',
                "            elif module_path in sys.modules[module_name].__path__:\n"
                "                # fairseq_plugins: imported by the user (say, for a model class), its\n"
                "                # tasks and models may not be registered yet\n"
                "                from fairseq.models import import_models\n"
                "                from fairseq.tasks import import_tasks\n"
                "\n"
                '                for folder, register in (("tasks", import_tasks), ("models", import_models)):\n'
                "                    if os.path.exists(os.path.join(module_path, folder)):\n"
                '                        register(os.path.join(module_path, folder), f"{module_name}.{folder}")\n',
            ),
        ),
    ),
    Fix(
        name="numpy2_compat_long",
        why=(
            "numpy 2 removed np.compat: token blocks in 'eos' mode (what fairseq-interactive and "
            "the hub build for a language model) and target-length bucketing died with "
            "AttributeError: module 'numpy' has no attribute 'compat'. np.compat.long was the "
            "Python int, which numpy stores as int64."
        ),
        edits=(
            TextEdit(
                "fairseq/data/token_block_dataset.py",
                "len(sizes), dtype=np.compat.long\n",
                "len(sizes), dtype=np.int64  # fairseq_plugins: np.compat is gone in numpy 2\n",
            ),
            TextEdit(
                "fairseq/data/language_pair_dataset.py",
                "num_tokens = np.vectorize(self.num_tokens, otypes=[np.compat.long])\n",
                "num_tokens = np.vectorize(self.num_tokens, otypes=[np.int64])  # fairseq_plugins: numpy 2\n",
            ),
        ),
    ),
    Fix(
        name="distributed_without_gpu",
        why=(
            "Several processes without --cpu on a machine without a GPU: fairseq's spawn ends in a "
            "bare 'AssertionError: world size is 2 but have 0 available devices', torchrun in three "
            "tracebacks ending 'Distributed package doesn't have NCCL built in'. Say in one line, "
            "before any process starts, to add --cpu or to use a machine with GPUs."
        ),
        edits=(
            TextEdit(
                _DIST,
                "        return\n\n    num_pipelines_per_node = None\n",
                "        return\n"
                "    # fairseq_plugins: without a GPU, several processes need --cpu (fairseq would count\n"
                "    # 0 GPUs to spawn processes on, and torchrun's processes would start NCCL)\n"
                "    launched = \"WORLD_SIZE\" in os.environ\n"
                "    if not (cpu or torch.cuda.is_available()) and (\n"
                "        cfg.distributed_backend == \"nccl\" if launched else cfg.distributed_world_size > 1\n"
                "    ):\n"
                "        processes = (\n"
                "            \"the processes started by torchrun use the NCCL backend, which needs GPUs\" if launched\n"
                "            else f\"--distributed-world-size {cfg.distributed_world_size} "
                "starts one process per GPU\"\n"
                "        )\n"
                "        message = (f\"{os.path.basename(sys.argv[0])}: error: {processes}, "
                "and this machine has none: \"\n"
                "                   \"add --cpu to run the processes on CPU (gloo), or use a machine with GPUs\")\n"
                "        if launched and os.environ.get(\"TORCHELASTIC_ERROR_FILE\"):  # torchrun's summary quotes it\n"
                "            import json, time\n"
                "\n"
                "            with open(os.environ[\"TORCHELASTIC_ERROR_FILE\"], \"w\") as f:\n"
                "                extra = {\"py_callstack\": message, \"timestamp\": str(int(time.time()))}\n"
                "                json.dump({\"message\": {\"message\": message, \"extraInfo\": extra}}, f)\n"
                "        raise SystemExit(message)\n"
                "\n"
                "    num_pipelines_per_node = None\n",
            ),
            TextEdit(_DIST, "import subprocess\nimport warnings\n", "import subprocess\nimport sys\nimport warnings\n"),
        ),
    ),
    Fix(
        name="interactive_bad_source_lines",
        why=(
            "fairseq-interactive translates an empty line into invented text, and one line longer "
            "than the model's source positions ends the whole session ('Size of sample #0 is "
            "invalid'). For translation tasks, skip such a line with a one-line error that names "
            "it (and the limit) and go on; the lines kept keep their numbers (S-, H- ids)."
        ),
        edits=(
            TextEdit(
                "fairseq_cli/interactive.py",
                "def make_batches(lines, cfg, task, max_positions, encode_fn):\n",
                "def make_batches(lines, cfg, task, max_positions, encode_fn, start_id=0):\n",
            ),
            TextEdit(
                "fairseq_cli/interactive.py",
                "    if cfg.generation.constraints:\n"
                "        constraints_tensor = pack_constraints(batch_constraints)\n"
                "    else:\n"
                "        constraints_tensor = None\n"
                "\n"
                "    tokens, lengths = task.get_interactive_tokens_and_lengths(lines, encode_fn)\n",
                "    # fairseq_plugins: a source line with nothing to translate, or longer than the model\n"
                "    # takes, is skipped with an error naming it; the session goes on with the next lines\n"
                "    from fairseq.tasks.translation import TranslationTask\n"
                "\n"
                "    translating = isinstance(task, TranslationTask)\n"
                "    limit = max_positions[0] if translating and max_positions is not None else None\n"
                "    kept, tokens, lengths = [], [], []\n"
                "    for i, line in enumerate(lines):\n"
                "        name = f\"input line {start_id + i + 1} (id {start_id + i})\"\n"
                "        if translating and not line.strip():\n"
                "            logger.error(f\"{name} is empty: nothing to translate; skipped\")\n"
                "            continue\n"
                "        encoded, encoded_lengths = task.get_interactive_tokens_and_lengths([line], encode_fn)\n"
                "        if not encoded:  # the task skipped the line, and said why\n"
                "            continue\n"
                "        if limit is not None and encoded_lengths[0] > limit:\n"
                "            logger.error(f\"{name} has {encoded_lengths[0]:,} tokens with </s>, more than the \"\n"
                "                         f\"{limit:,} source positions allowed; skipped\")\n"
                "            continue\n"
                "        kept.append(i)\n"
                "        tokens.append(encoded[0])\n"
                "        lengths.append(encoded_lengths[0])\n"
                "    if not kept:\n"
                "        return\n"
                "    if cfg.generation.constraints:\n"
                "        constraints_tensor = pack_constraints([batch_constraints[i] for i in kept])\n"
                "    else:\n"
                "        constraints_tensor = None\n",
            ),
            TextEdit(
                "fairseq_cli/interactive.py",
                "    for batch in itr:\n        ids = batch[\"id\"]\n",
                "    for batch in itr:\n"
                "        ids = torch.as_tensor(kept)[batch[\"id\"]]  # fairseq_plugins: the line's own number\n",
            ),
            TextEdit(
                "fairseq_cli/interactive.py",
                "        for batch in make_batches(inputs, cfg, task, max_positions, encode_fn):\n",
                "        for batch in make_batches(inputs, cfg, task, max_positions, encode_fn, start_id):\n",
            ),
        ),
    ),
)


def local_version() -> str:
    """The version of a fairseq built with exactly these fixes: 0.12.2+plugins.<hash of the edits>."""
    digest = hashlib.sha256()
    for fix in FIXES:
        for edit in fix.edits:
            digest.update(repr((fix.name, edit.path, edit.old, edit.new)).encode())
    return f"{SUPPORTED_FAIRSEQ_VERSION}+plugins.{digest.hexdigest()[:10]}"


def _edit_status(text: str, edit: TextEdit) -> str:
    if edit.new and edit.new in text:
        return APPLIED
    if text.count(edit.old) == 1:
        return MISSING
    if not edit.new and edit.old not in text:  # a pure deletion is applied once the old text is gone
        return APPLIED
    raise FairseqFixError(
        f"unknown fairseq source in {edit.path}: expected {edit.old!r} once. "
        f"Reinstall fairseq with {setup_command()} (it builds 0.12.2 with these fixes)."
    )


def _check_version(tree) -> None:
    version = tree.version()
    if version.split("+")[0] != SUPPORTED_FAIRSEQ_VERSION:
        raise FairseqFixError(
            f"fairseq {version} at {tree}: these fixes are written for "
            f"fairseq {SUPPORTED_FAIRSEQ_VERSION} only. Install it with {setup_command()}."
        )


def fix_status(fix: Fix, tree) -> str:
    """APPLIED when every edit of the fix is in place in the tree, else MISSING."""
    statuses = {_edit_status(tree.file(e.path).read_text(), e) for e in tree.edits(fix)}
    return APPLIED if statuses == {APPLIED} else MISSING


def check(tree=None) -> Dict[str, str]:
    """Status of every fix by name in a tree (default: the installed fairseq).
    Raises FairseqFixError for an unknown fairseq."""
    tree = tree or InstalledTree()
    _check_version(tree)
    return {fix.name: fix_status(fix, tree) for fix in FIXES}


def apply(tree: SourceTree) -> Dict[str, str]:
    """Apply the missing fixes to an unpacked sdist and give it the local version label;
    return what each fix did ('applied now' or 'already applied')."""
    if not isinstance(tree, SourceTree):
        raise FairseqFixError("fixes are applied to fairseq's source before it is built, never in place")
    _check_version(tree)
    done = {}
    for fix in FIXES:
        if fix_status(fix, tree) == APPLIED:
            done[fix.name] = "already applied"
            continue
        for edit in fix.edits:
            path = tree.file(edit.path)
            text = path.read_text()
            if _edit_status(text, edit) == MISSING:
                path.write_text(text.replace(edit.old, edit.new, 1))
        done[fix.name] = "applied now"
    tree.file("fairseq/version.txt").write_text(local_version())
    return done


def require_fixed() -> None:
    """Raise a clear error when fairseq runs without our fixes (called when models load)."""
    missing = [name for name, status in check().items() if status != APPLIED]
    if missing:
        raise FairseqFixError(
            f"the installed fairseq {installed_fairseq_version()} lacks fixes {missing}: run "
            f"{setup_command()}, which installs fairseq 0.12.2 built with them "
            f"({local_version()}); a reinstall of fairseq from PyPI undoes them"
        )


def main(argv=None) -> int:
    parser = command_parser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True, help="what to do")
    sub.add_parser("check", help="report the fixes of the installed fairseq; exit 1 if one is missing")
    apply_parser = sub.add_parser("apply", help="apply the fixes to an unpacked fairseq 0.12.2 sdist")
    apply_parser.add_argument("source", type=Path, help="the sdist's folder (holds setup.py and fairseq/)")
    sub.add_parser("version", help="print the version a fairseq built with these fixes carries")
    args = parser.parse_args(argv)
    if args.action == "version":
        print(local_version())
        return 0
    tree = SourceTree(args.source) if args.action == "apply" else InstalledTree()
    try:
        report = check(tree) if args.action == "check" else apply(tree)
    except FairseqFixError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"fairseq {tree.version()} at {tree}")
    for fix in FIXES:
        print(f"  {fix.name:28s} {report[fix.name]}")
    if args.action == "check" and MISSING in report.values():
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
