"""Pictures: figure7.py (the paper's Figure 7 as numbers and PNGs), figure2.py (MAE's Figure 2:
original, masked input, the decoder's output, output + visible), attention.py (DINO's Figure 1:
the class token's last-layer attention per head), curves.py (training curves from
metrics.jsonl), confusion.py (`vit evaluate`'s confusion matrix), reliability.py (its reliability
diagram), fewshot.py (`vit eval-fewshot`'s accuracy against shots); canvas.py (a Figure to draw on:
matplotlib is imported only then)."""
