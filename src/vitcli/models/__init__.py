"""The networks: posemb.py (position tables, resampling), mpp.py (masked patch prediction maths),
mae.py (masked autoencoders: masking, loss, sin-cos tables, the decoder), dino_head.py,
dino_loss.py and ibot_masks.py (DINO's projection head, its losses, centring and schedules, iBOT's
masks), dino.py (DINO's student and teacher), t2t.py (T2T-ViT), zoo.py
(names -> architectures, one builder for every family), flops.py (a ViT's FLOPs per image, for MFU),
layer_decay.py (a model's layers and their lr multipliers under layer-wise lr decay), dino_head.py
(DINO's projection head), dino_loss.py (DINO's and DINOv2's losses, targets, schedules and collapse
monitors), ibot_masks.py (iBOT's block masks per image)."""
