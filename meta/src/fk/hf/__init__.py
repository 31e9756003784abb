"""fk.hf: the fk meta-package's Hugging Face integration.

Model patchers (``fk.hf.apply``) arrive with the meta-package issue; today this package holds the
demo (``python -m fk.hf.demo``), which runs every installed fk kernel against its reference.
"""
