"""Recipes as typed dataclasses: one recipe is one experiment, every key with its declared type and
default. layers.py reads YAML and `a.b=c` overrides onto them (defaults < recipe file < overrides)
and writes the resolved recipe back as YAML, the `WORKDIR/recipe.yaml` stored in every
checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field

from vitcli.recipe.choices import (
    Centering,
    Decay,
    Device,
    DistillType,
    EmaSave,
    ErasingMode,
    EvalCropMode,
    FewshotResizeMethod,
    Interpolation,
    Loss,
    MixMode,
    MppTarget,
    Objective,
    OptimName,
    Pool,
    PosEmbed,
    PosembMethod,
    Precision,
    Stage,
    Strategy,
    WeightDecayConvention,
)


@dataclass
class ModelConfig:
    """The network. Named models (`ViT-B/16`, `T2T-ViT-14`, any timm name) fill in the sizes
    themselves."""

    # paper name, T2T-ViT-N (Performer token mixer) / T2T-ViT_t-N (Transformer), BiT-R50x1,
    # R50+ViT-B/16, a timm name, or "custom"
    name: str = "custom"
    img_size: int = 224  # train and eval resolution; must be a multiple of patch_size
    patch_size: int = 16
    embed_dim: int = 768  # "width" in the paper's Table 1
    depth: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    # token (class token, the paper's default) | gap (global average pool, final norm before it) |
    # gap_fc_norm (MAE's fine-tune: class token kept, mean of the patch tokens, then fc_norm;
    # recipe.choices.POOLS)
    pool: Pool = "token"
    # learned_1d | learned_2d | sincos_2d | none (paper App. D.4); T2T: sincos_1d
    pos_embed: PosEmbed = "learned_1d"
    representation_size: int = 0  # >0 adds Dense+tanh before the head, as in the i21k checkpoints
    # every LayerNorm's eps: timm's ViT 1e-6; transformers' ViTConfig (and google's converted
    # folders) 1e-12
    layer_norm_eps: float = 1e-6
    dropout: float = 0.0
    drop_path: float = 0.0
    num_classes: int = 0  # 0: taken from the dataset's ClassLabel feature or data.num_classes
    head_bias_init: float = 0.0  # -10 with sigmoid loss on ImageNet-21k keeps early logits tiny
    # big_vision and vit_jax start the head kernel at zero (`head_zeroinit`), so the first logits
    # are the bias alone; false keeps timm's random kernel. Fine-tuning always zeroes the whole new
    # head (paper, Sec. 3.2).
    head_zero_init: bool = True


@dataclass
class SyntheticConfig:
    """Sizes of the built-in procedural dataset (used when data.source is `synthetic`)."""

    num_classes: int = 10
    train_size: int = 5000
    val_size: int = 500
    test_size: int = 1000
    # native resolution the images are drawn at; transforms resize to model.img_size
    img_size: int = 32
    seed: int = 0


@dataclass
class DataConfig:
    """Where images come from and how they are batched and augmented."""

    # synthetic | Hub id | save_to_disk dir | parquet/arrow file(s) | image folder | WebDataset .tar
    # shards
    source: str = "synthetic"
    image_column: str = "image"
    label_column: str = "label"
    train_split: str = "train"  # HF split syntax, slicing allowed: train[:98%]
    val_split: str = "validation"  # held-out split for periodic eval; "" disables it
    test_split: str = "test"  # "" disables the final test evaluation
    # a fraction of train_split held out, the same share of each class, seeded
    # (data/rows/holdout.py): the split `holdout` names those rows and training reads the rest
    # (big_vision's minival, `train[99%:]` of its shuffled ImageNet files; an image folder's last
    # 1% is its last ~10 classes). 0: off
    holdout: float = 0.0
    num_classes: int = 0  # 0: from the ClassLabel feature
    # derive the label from raw columns (VTAB: clevr_count, kitti_closest_vehicle, ...)
    label_rule: str = ""
    binary_pixels: bool = False  # images stored as 0/1 (dSprites): decoded as 0/255, as VTAB does
    batch_size: int = 512  # global batch per optimizer step, reached by accumulation if needed
    # per-process forward/backward batch; 0 = batch_size / world size; auto = the largest divisor of
    # that which fits run.memory_budget_mb, found by trial steps before training
    # (run/micro_batch.py)
    micro_batch_size: int | str = 0
    # repeated augmentation k, DeiT's RASampler: an epoch's images k times each, the copies in
    # different micro-batches (on different processes when each takes one micro-batch per step),
    # each copy with its own augmentation draws; an epoch stays len(split) images, so ~len / k
    # distinct ones. 1 = off; DeiT: 3. A map-style split only (not data.streaming).
    repeated_aug: int = 1
    eval_batch_size: int = 256
    num_workers: int = 2
    # training keeps its images decoded, one copy shared by the loader workers, when they take at
    # most 192 MiB on disk (CIFAR, a VTAB-1k task; data/decoding/image_cache.py): at most this many
    # MiB of pixels on this host, whatever the images turn out to be. 0 turns the cache off.
    cache_mb: int = 1024
    # read the train split as a stream (Hub, parquet/arrow/json files, a save_to_disk dir) instead
    # of loading it whole: for splits larger than the disk or the patience to download them.
    # Val/test still load whole. WebDataset tar shards always stream (resolve sets it; an explicit
    # false is refused).
    streaming: bool = False
    # streaming: examples mixed at once (HF IterableDataset.shuffle buffer_size)
    shuffle_buffer: int = 10_000
    inception_crop: bool = True  # random-resized crop over crop_min_area..100% of the image
    crop_min_area: float = 0.05
    hflip: bool = True
    # per-image augmentation, batched on uint8 where the model runs
    # (data/augmentation/augmentations.py): a timm RandAugment spec, e.g. "rand-m9-mstd0.5-inc1" (""
    # disables); or DeiT III's 3-Augment (one of grayscale, solarize, blur per image) with colour
    # jitter of strength color_jitter
    randaugment: str = ""
    three_augment: bool = False
    color_jitter: float = 0.0
    # random erasing after normalisation, timm's RandomErasing: the probability per image (timm's
    # reprob; 0 disables), the fill (pixel | rand | const) and the boxes per erased image
    erasing: float = 0.0
    erasing_mode: ErasingMode = "pixel"
    erasing_count: int = 1
    # mixup and CutMix with timm's Mixup semantics, on the device: alphas (0 disables each), the
    # probability a micro-batch is mixed at all, of CutMix when both are on, and batch | pair | elem
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    mix_prob: float = 1.0
    mix_switch_prob: float = 0.5
    mix_mode: MixMode = "batch"
    eval_crop_pct: float = 1.0  # eval: resize to img_size / crop_pct, then centre crop img_size
    # which sides that resize sets: center the shorter one (aspect kept) | squash both
    # (transformers' ViTImageProcessor and vit_jax feed google's ViTs so); timm's crop_mode
    eval_crop_mode: EvalCropMode = "center"
    # what the model is fed: (x / 255 - mean) / std per RGB channel. 0.5 and 0.5 are the ViT paper's
    # [-1, 1]; weights trained on other inputs say theirs (timm's pretrained_cfg, a transformers
    # preprocessor, our own recipe: vitcli.checkpoints.preprocessing), which this recipe's keys
    # override
    mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    std: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    # the resize of training crops and eval images: bilinear (training: big_vision's, no antialias;
    # eval: antialiased, as timm's) | bicubic (antialiased, PIL's and timm's) | nearest. Few-shot
    # features keep fewshot.resize_method
    interpolation: Interpolation = "bilinear"
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    # the batches of these steps of a run without skips are skipped, "A-B" (steps A..B as
    # metrics.jsonl numbers them) or "A": a rollback past a loss spike records its skip so, and a
    # run given it up front trains what the rolled-back run trained (train/rollback.py)
    skip_steps: list[str] = field(default_factory=list)


@dataclass
class OptimConfig:
    """Optimizer and loss."""

    # adamw (the paper's Adam, decoupled decay) | sgd (momentum, for fine-tuning)
    name: OptimName = "adamw"
    lr: float = 1e-3  # peak learning rate, reached at the end of warmup
    weight_decay: float = 0.03  # not applied to biases, norms, position embedding, class token
    # torch: decay each step by lr_t * weight_decay (torch AdamW; flax.optim.Adam, so the paper's
    # Table 3). big_vision: by schedule_t * weight_decay, not scaled by the peak lr (optax
    # add_decayed_weights before the schedule), so a big_vision config's `wd` ports unchanged: its
    # 1e-4 at lr 1e-3 is torch's 0.1.
    weight_decay_convention: WeightDecayConvention = "torch"  # torch | big_vision
    # layer-wise lr decay (BEiT, MAE fine-tuning; timm's param_groups_layer_decay): of a ViT's L + 2
    # layers (the embeddings 0, block j at j + 1 and the final norm with the last, the head L + 1),
    # layer i trains at lr_t * layer_decay^(L + 1 - i), and decays its weights in proportion. In (0,
    # 1]; 1: off
    layer_decay: float = 1.0
    # the patch embedding's lr times this (DINOv2's patch_embed_lr_mult, 0.2 in its
    # ssl_default_config.yaml), on top of layer_decay; objective: dino's parameter groups
    patch_embed_lr_scale: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.999
    momentum: float = 0.9  # sgd only
    clip_grad_norm: float = 1.0  # global-norm clip; 0 disables
    # the weight decay at the last step, reached by a cosine from weight_decay (DINO's 0.04 -> 0.4);
    # -1: constant
    weight_decay_end: float = -1.0
    label_smoothing: float = 0.0
    # softmax | sigmoid (per-class binary cross-entropy, as for ImageNet-21k)
    loss: Loss = "softmax"


@dataclass
class ScheduleConfig:
    """How long to train and how the learning rate moves."""

    steps: int = 0  # optimizer steps; 0: derived from epochs and the train split size
    epochs: float = 0.0
    warmup_steps: int = 10_000
    decay: Decay = "linear"  # linear | cosine | constant
    end_lr: float = 0.0  # learning rate at the last step


@dataclass
class EmaConfig:
    """Weight EMA (timm's ModelEmaV3): an exponential moving average of the weights, updated after
    each optimizer step, evaluated beside them (`val_ema/top1`) and kept in every checkpoint."""

    # the average's decay per optimizer step; 0 turns EMA off (timm's train.py: 0.9998; DeiT:
    # 0.99996)
    decay: float = 0.0
    min_decay: float = 0.0  # floor of the warmed-up decay (timm's min_decay)
    # optimizer steps after the first that only copy the weights (timm's)
    update_after_step: int = 0
    # the decay warms up as min(decay, 1 - (1 + t / warmup_gamma) ** -warmup_power), t counting the
    # averaging steps, so the early average is not the random initial weights' (timm's use_warmup)
    warmup: bool = False
    warmup_gamma: float = 1.0
    warmup_power: float = 2 / 3  # timm's: reaches 0.999 at 31.6K steps, 0.9999 at 1M
    save: EmaSave = "live"  # which weights model.safetensors holds: live (the trained ones) | ema


@dataclass
class RunConfig:
    """Everything about running that does not change the maths."""

    seed: int = 0
    # auto | fp32 | bf16 (autocast; weights and optimizer stay fp32). auto: bf16 where the device
    # runs it natively (CUDA with bf16, a CPU with AVX-512 bf16 or AMX), fp32 where bf16 would be
    # emulated
    precision: Precision = "auto"
    # torch.compile the model for training (seconds to minutes of compiling first; exports
    # unchanged). auto | true | false. auto: on where the device gains (CUDA: ~3x for a small ViT),
    # off on a CPU (0.89x measured); the run's recipe.yaml holds the choice
    # (runtime.precision.choose_compile)
    compile: bool | str = "auto"
    device: Device = "auto"  # auto | cpu | cuda
    log_every: int = 10  # steps between metrics.jsonl train rows
    eval_every: int = 0  # steps between held-out evaluations; 0 = only at the end
    ckpt_every: int = 500  # steps between resumable checkpoints; the last step always saves
    # also checkpoint when this long has passed since the last one; 0: off
    ckpt_every_minutes: float = 30.0
    # resumable checkpoints kept; a damaged latest one falls back to the one before
    keep_checkpoints: int = 2
    # where every finished checkpoint is also uploaded (its checksum object last), keeping
    # keep_checkpoints there too: an fsspec URI (s3://bucket/prefix, gs://..., file:///...) or a
    # path. "" = the workdir only. Why: a node's local disk dies with the node; a run resumes from
    # the remote when it holds a newer good checkpoint than the workdir (checkpoints.remote)
    ckpt_dir: str = ""
    # write checkpoints in a background thread: the loop waits only while the state is copied to
    # host memory (one more copy of model, optimizer and EMA held), the write goes on during
    # training (checkpoints.writer). false: the loop waits for the whole write, as before
    ckpt_async: bool = True
    # ddp: every process holds the whole model, optimizer and gradients (state-<step>.pt
    # checkpoints). fsdp: FSDP2 shards them over the processes block by block (state-<step>/
    # directories, one file per process); with one process there is nothing to shard over, so it
    # runs unsharded but writes the same directories
    strategy: Strategy = "ddp"
    # recompute each transformer block's activations in the backward pass instead of keeping them:
    # about a third more compute for far less activation memory; the gradients do not change
    activation_checkpointing: bool = False
    # MiB data.micro_batch_size=auto may fill, per process: on CUDA its device memory (the caching
    # allocator's peak and the CUDA context); on a CPU the whole run's, every process of it (this
    # process, with what it holds before its first batch, ~850-1100 MiB of torch and the data; the
    # steps, EMA or teacher, a staged checkpoint copy, a held-out pass; loader workers and the
    # decoded-image cache; the exit; and during the search a trial's process beside it), so a cap
    # (cgroup, SLURM --mem) at this figure is not passed (run/micro_batch.py). 0 = a GPU's total
    # memory; on a CPU, MemAvailable shared by the node's processes, plus what this one holds
    memory_budget_mb: int = 0
    # metrics.jsonl is always written; tensorboard (WORKDIR/tensorboard), wandb (offline without
    # an account), mlflow and trackio (local-first: a store on this machine) are optional extras:
    # pip install 'vitcli[tensorboard]' / 'vitcli[wandb]' / 'vitcli[mlflow]' / 'vitcli[trackio]'
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])
    # run.loggers=[mlflow]: the tracking server or store (http://host:5000, sqlite:///mlflow.db).
    # "" = MLFLOW_TRACKING_URI, else MLflow's own default (./mlflow.db), as MLflow's users expect
    mlflow_uri: str = ""
    # the MLflow experiment and the trackio project the run is filed under; "" = the environment's
    # MLFLOW_EXPERIMENT_NAME (mlflow) or "vitcli". One key for both: the same grouping of runs
    experiment: str = ""
    # a loss spike rolls the run back to its newest checkpoint and skips the batches since
    # (PaLM's practice; train/rollback.py). A loss is a spike when it is not finite, or (factor > 0)
    # above spike_factor x the median of the last spike_window losses read: 0 = non-finite only
    spike_factor: float = 0.0
    spike_window: int = 20  # losses read (every run.log_every steps and at checkpoints)
    # rollbacks before the run stops with the steps that spiked; 0 = stop at the first (no rollback)
    max_rollbacks: int = 3
    # The watchdog of each rank (train/watchdog.py): a step running past max(hang_floor_s,
    # hang_factor x the median of the last 50 steps) is a hang: every thread's stack goes to the log
    # and the rank exits 75, for torchrun's --max-restarts or the SLURM requeue to resume the run.
    # 10x and 5 minutes: a healthy step past both is not seen (what is slow between steps,
    # evaluations and checkpoint writes, is not watched); a hang costs 5 minutes, not the
    # allocation. 0 = no watchdog; otherwise at least 2 (a bound under 2x the median is one slow
    # step)
    hang_factor: float = 10.0
    hang_floor_s: float = 300.0  # positive while the watchdog is on
    # the bound of the first 5 steps of a process (no median yet): compilation, the loader's
    # start-up and the first images decoded take far longer than a step; 0: not watched until then
    hang_start_s: float = 1800.0


@dataclass
class InitConfig:
    """Starting weights for fine-tuning (the paper's transfer protocol by default)."""

    # vitcli workdir / model.safetensors, timm safetensors, Google .npz, Hub name
    checkpoint: str = ""
    keep_head: bool = False  # False: drop the pretrained head, attach a zero-initialised D x K head
    keep_representation: bool = False  # the paper drops the pre-logits layer when fine-tuning
    # bilinear (big_vision / vit_jax) | bicubic (timm, antialiased)
    posemb_method: PosembMethod = "bilinear"
    # HxW: the patch grid the checkpoint's 1-D position table spans, for a file that cannot tell (a
    # table of 4x5 = 20 positions, trained on 32x40 images at patch 8); "" = the file's own
    # (metadata, or a square)
    grid: str = ""
    # eval-fewshot: the checkpoint's network with fresh weights (run.seed), the baseline
    random: bool = False


@dataclass
class CustomTaskConfig:
    """A few-shot task of your own, named in fewshot.tasks by `name`."""

    name: str = ""  # "" = no custom task
    source: str = ""  # anything data.source accepts
    train_split: str = "train"
    test_split: str = "test"
    image_column: str = "image"
    label_column: str = "label"
    num_classes: int = 0  # 0: from the ClassLabel feature


@dataclass
class FewshotConfig:
    """Linear few-shot evaluation by closed-form least squares (big_vision `fewshot_lsr`)."""

    tasks: list[str] = field(default_factory=list)
    shots: list[int] = field(default_factory=lambda: [1, 5, 10, 25])
    seeds: int = 3
    l2_reg: str = "1024"  # a number, or "auto" for leave-one-out choice on the shot set
    every: int = 0  # steps between few-shot runs inside training; 0 disables
    data_root: str = ""  # one directory per task, read by the data layer, instead of the Hub
    # at 224 px (big_vision: resize to 256, centre crop 224), scaled to img_size; >= 224
    resize: int = 256
    # big_vision: tf bilinear without antialias, as big_vision's few-shot pp, so numbers compare
    # with its own;
    resize_method: FewshotResizeMethod = "big_vision"
    cache_dir: str = ""  # feature cache; "" = WORKDIR/features
    custom: CustomTaskConfig = field(default_factory=CustomTaskConfig)
    # what scores the frozen features, in training and in eval-fewshot, all from one extraction per
    # split: fewshot (the above), knn (DINO's weighted kNN), linear (a logistic probe on all of
    # train, CLIP's protocol), ridge (the closed-form least squares on all of train, λ by
    # leave-one-out)
    protocols: list[str] = field(default_factory=lambda: ["fewshot"])
    knn_k: int = 20  # DINO's headline k
    knn_temperature: float = 0.07  # DINO's T: each neighbour's vote is exp(cosine similarity / T)
    # linear: the fraction of train that chooses λ (VTAB-1k's 200 of 1,000)
    probe_holdout: float = 0.2


@dataclass
class MppConfig:
    """Masked patch prediction (paper App. B.1.2): the self-supervised objective, used with
    objective: mpp."""

    # mean_color (the paper's choice, 512 classes) | color_4x4 | pixels_l2
    target: MppTarget = "mean_color"
    corrupt_ratio: float = 0.5  # fraction of each image's patch embeddings corrupted
    mask_prob: float = 0.8  # of the corrupted: replaced by the learned [mask] embedding
    # of the corrupted: replaced by another patch's embedding; the rest stay as is
    random_prob: float = 0.1


@dataclass
class MaeConfig:
    """Masked autoencoders (He et al. 2022; facebookresearch/mae): the self-supervised objective of
    objective: mae. The defaults are the paper's (models_mae.py's mae_vit_*_dec512d8b,
    main_pretrain.py)."""

    # fraction of each image's patches removed; the encoder sees int(N (1 - ratio))
    mask_ratio: float = 0.75
    decoder_embed_dim: int = 512  # the decoder's width; its MLP is 4x that, as in MAE
    decoder_depth: int = 8
    decoder_num_heads: int = 16
    # targets: each patch less its mean, over its std (MAE's pretraining setting)
    norm_pix_loss: bool = True


@dataclass
class DinoConfig:
    """Self-distillation without labels (Caron et al. 2021, facebookresearch/dino; DINOv2's terms as
    keys: Oquab et al. 2023, facebookresearch/dinov2): the self-supervised objective of objective:
    dino. The defaults are the DINO paper's ViT-S/16 (main_dino.py); recipes/pretrain/dinov2_*.yaml
    turns on DINOv2's iBOT, KoLeo and Sinkhorn-Knopp (ssl_default_config.yaml)."""

    # the projection head (DINOHead): 3-layer MLP, hidden 2048, bottleneck 256, a weight-normalised
    # last layer of out_dim prototypes
    out_dim: int = 65536
    hidden_dim: int = 2048
    bottleneck_dim: int = 256
    head_layers: int = 3
    # the last layer's norm (weight_g) fixed at 1 (DINO's norm_last_layer); false trains it (DINOv2)
    norm_last_layer: bool = True
    freeze_last_layer_epochs: float = 1.0  # the last layer is not updated for this long
    # DINO's gradient clip: each parameter's gradient norm at most this (0 = off; DINOv2 clips the
    # backbone and each head as a whole instead); optim.clip_grad_norm (one global norm) must be 0
    # beside it
    clip_grad: float = 3.0
    # the teacher: an EMA of the student whose momentum rises to momentum_end by a cosine
    momentum: float = 0.996
    momentum_end: float = 1.0
    teacher_temp: float = 0.04
    # the teacher's temperature rises linearly from warmup_teacher_temp over this many epochs
    warmup_teacher_temp: float = 0.04
    warmup_teacher_temp_epochs: float = 0.0
    student_temp: float = 0.1
    # center: DINO's running centre of the teacher's outputs (center_momentum); sinkhorn: DINOv2's
    # Sinkhorn-Knopp over the global batch (sinkhorn_iterations)
    centering: Centering = "center"
    center_momentum: float = 0.9
    sinkhorn_iterations: int = 3
    # multi-crop: two global crops of model.img_size over global_crop_scale of the area, local_crops
    # crops of local_crop_size over local_crop_scale
    global_crop_scale: list[float] = field(default_factory=lambda: [0.4, 1.0])
    local_crops: int = 8
    local_crop_size: int = 96
    local_crop_scale: list[float] = field(default_factory=lambda: [0.05, 0.4])
    # BYOL's colour augmentation: jitter (0.4, 0.4, 0.2, 0.1) and grayscale with these
    # probabilities; Gaussian blur on the first global, second global and local crops; solarisation
    # on the second global crop
    color_jitter_prob: float = 0.8
    grayscale_prob: float = 0.2
    blur_prob: list[float] = field(default_factory=lambda: [1.0, 0.1, 0.5])
    # the blur's sigma, in pixels of the resized crop (both references': 0.1 to 2 at 224 and 96 px;
    # scale it down with the crops for small images)
    blur_sigma: list[float] = field(default_factory=lambda: [0.1, 2.0])
    solarize_prob: float = 0.2
    # DINOv2's iBOT masked-token loss (0 = off; DINOv2: 1): on ibot_mask_prob of the global crops,
    # ibot_mask_ratio of the patches masked; the DINO head shared unless ibot_separate_head
    ibot_weight: float = 0.0
    ibot_separate_head: bool = False
    ibot_mask_prob: float = 0.5
    ibot_mask_ratio: list[float] = field(default_factory=lambda: [0.1, 0.5])
    # DINOv2's KoLeo regulariser on the student's class tokens (0 = off; DINOv2: 0.1), over groups of
    # koleo_group consecutive images of the global batch (DINOv2: each GPU's batch)
    koleo_weight: float = 0.0
    koleo_group: int = 64


@dataclass
class DistillConfig:
    """Knowledge distillation as DeiT does it (Touvron et al. 2021; facebookresearch/deit
    losses.py): a frozen teacher's logits on the images the student sees, a second target beside the
    labels (train/distill.py)."""

    # the teacher's weights: a vitcli workdir / model.safetensors, a timm safetensors, a Google
    # .npz, or a timm / Hub model name (timm downloads it); "" = no teacher
    teacher: str = ""
    # the teacher's architecture, any model.name (DeiT's regnety_160), for a file that does not say
    # it (a foreign network that is not a ViT); "" = read from the checkpoint or the timm name
    teacher_model: str = ""
    # none | hard (cross-entropy on the teacher's top class) | soft (KL at temperature)
    type: DistillType = "none"
    # the distillation loss's weight; the labels' loss gets 1 - alpha (DeiT's 0.5)
    alpha: float = 0.5
    tau: float = 1.0  # soft: the temperature of both softmaxes (DeiT's 1.0)


@dataclass
class SlurmConfig:
    """Where `--slurm` sends the run: sbatch's resources, one task per node, each running torchrun
    with c10d rendezvous on the first node (vitcli.cluster.slurm writes the batch script)."""

    nodes: int = 1
    gpus_per_node: int = 0  # sbatch --gpus-per-node; 0 asks for none (a CPU partition)
    procs_per_node: int = 0  # torchrun's --nproc-per-node; 0 = gpus_per_node, or 1 without GPUs
    # CPUs of each node's task (all of its processes); 0 = the partition's default
    cpus_per_task: int = 0
    # memory per node, as sbatch's --mem says it (500G; 0 = all of it); "" = the default
    mem: str = ""
    partition: str = ""
    account: str = ""
    # the time limit, as sbatch's --time says it (minutes, H:MM:SS, D-HH:MM); "" = the default
    time: str = ""
    qos: str = ""
    constraint: str = ""
    extra: list[str] = field(default_factory=list)  # more #SBATCH lines, e.g. "--exclusive"
    # seconds before the time limit that SLURM sends SIGUSR2: each rank checkpoints at its next
    # step, and the job requeues itself (submitit's 90 s). Leave a step, a checkpoint write and the
    # exit inside it.
    signal_seconds: int = 90
    # requeues after a time limit, at most (a preemption always requeues, a user's scancel never);
    # a stop that made no progress after one that made none is not requeued again
    max_requeues: int = 20
    port: int = 29500  # the c10d rendezvous port on the first node
    array_parallel: int = 0  # a sweep's job array: at most this many points at once; 0 = no limit
    # requeues after a rank hung (the watchdog's exit) or was killed by SIGKILL (out of memory), at
    # most: a restart may cure either, a bug would fail again; a stop that made no progress after
    # one that made none is never requeued
    max_restarts: int = 2


@dataclass
class SearchConfig:
    """How `--search` draws and prunes its trials (stages/search.py): Optuna's TPE sampler and
    median pruner, their defaults Optuna's own. Never part of what a trial trains."""

    # trials drawn at random before TPE models the ones done (optuna TPESampler n_startup_trials)
    startup_trials: int = 10
    # trials finished before any is pruned (MedianPruner n_startup_trials): a median of fewer is
    # one trial's luck
    prune_after: int = 5
    # a trial's steps before it may be pruned (MedianPruner n_warmup_steps): early evaluations
    # rank the learning rates by their warm-up more than by where they end
    prune_warmup_steps: int = 0


@dataclass
class Recipe:
    """One experiment."""

    # pretrain | finetune | eval-fewshot: set by the command, checked against the file
    stage: Stage = "pretrain"
    # supervised (labels) | mpp (masked patch prediction) | mae (masked autoencoder); the last two
    # pretrain
    objective: Objective = "supervised"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    run: RunConfig = field(default_factory=RunConfig)
    init: InitConfig = field(default_factory=InitConfig)
    fewshot: FewshotConfig = field(default_factory=FewshotConfig)
    mpp: MppConfig = field(default_factory=MppConfig)
    mae: MaeConfig = field(default_factory=MaeConfig)
    dino: DinoConfig = field(default_factory=DinoConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    search: SearchConfig = field(default_factory=SearchConfig)  # --search: sampler and pruner


def micro_batches(recipe: Recipe, world_size: int = 1) -> tuple[int, int]:
    """(micro-batch, accumulation): each process's forward/backward batch (data.micro_batch_size, or
    0 for data.batch_size / world_size) and how many of them it sums per optimizer step, batch_size
    / (micro x world_size). Accumulation is 0 when the micro-batch is not positive (recipe.checks
    refuses that, and a micro-batch x world size that does not divide data.batch_size). A
    micro-batch of `auto` must have been resolved first (run.micro_batch.resolved)."""
    d = recipe.data
    if d.micro_batch_size == "auto":  # read as 0 it would silently train without accumulation
        raise ValueError("data.micro_batch_size auto: pass the recipe run.micro_batch.resolved returns")
    micro = d.micro_batch_size or d.batch_size // world_size
    return micro, d.batch_size // (micro * world_size) if micro > 0 else 0
