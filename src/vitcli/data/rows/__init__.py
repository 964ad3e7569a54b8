"""Where a split's rows come from: sources.py (every image source as a datasets.Dataset or a stream,
and the checks every split passes) over one reader per kind of source, picked by reader_factory.py:
reader.py (the interface and HF's split syntax), reader_synthetic.py (the built-in data),
reader_hub.py (a Hub id), reader_saved.py (a save_to_disk directory), reader_files.py (parquet/arrow
files), reader_folder.py (an image folder), reader_prepared.py (a prepared parquet copy),
reader_tars.py (WebDataset tar shards, a prepared tar copy's too); folder_listing.py (a plain image
folder listed by HF imagefolder's rules) < folder_index.py (its rows as HF gives them, listed in
seconds and cached), tar_shards.py
(WebDataset tar shards: naming, columns, writing, a shard cut short), synthetic.py (the built-in
dataset), tasks.py (the VTAB-1k and few-shot task registry), imagenet.py (ImageNet's label spaces as
timm ships them), holdout.py (data.holdout: a seeded class-balanced share of the train split held
out for validation) and prepare.py (a pre-resized copy of a source, `vit prepare-data`)."""
