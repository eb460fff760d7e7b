"""Mixture-of-experts models: the MoE block (layer.py), the families' routers (families.py), the
router losses (losses.py) and what a run measures and adjusts between steps (signals.py)."""
