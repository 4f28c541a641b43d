"""Training recipe for plugserve's embedded default model: a small DeepSeek-V3-structured model with its NextN
layer, trained on the Python and Django documentation and exported in DeepSeek-V3's block-FP8 format."""
