"""Frameworks that drive a pipe: transformers' Trainer (`gpipe_fast.integrations.transformers`).

Nothing here is imported by `import gpipe_fast`: a framework is needed only by who uses it.
"""
