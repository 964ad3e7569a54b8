"""Where a split's rows come from: sources.py (every image source as a datasets.Dataset or a stream: the
built-in data, saved datasets, parquet/arrow files, image folders, tar shards, prepared copies, Hub ids),
folder_index.py (a plain image folder's rows as HF's imagefolder gives them, listed in seconds and cached),
tar_shards.py (WebDataset tar shards: naming, columns, writing), synthetic.py (the built-in dataset),
tasks.py (the VTAB-1k and few-shot task registry), imagenet.py (ImageNet's label spaces as timm
ships them), holdout.py (data.holdout: a seeded class-balanced share of the train split held out for
validation) and prepare.py (a pre-resized copy of a source, `vit prepare-data`)."""
