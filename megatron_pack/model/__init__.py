"""The model: megatron-core ``GPTModel`` with a THD attention core (torch or Transformer Engine).

``build_model(cfg, pg)`` lives in ``megatron_pack.model.builder``; the pure-torch THD attention
(``thd_attention``, ``ThdCoreAttention``) in ``megatron_pack.model.attention``. Importing this
package does not import megatron-core; import the submodules.
"""
