"""Attention masks of the diffusion strategies, one file per family (dense additive for sdpa/eager,
flex `BlockMask` for `flex_attention`). Import the module you need, e.g.

    from dllmflow.diffusion.masks.idlm import idlm_dense_mask
"""
