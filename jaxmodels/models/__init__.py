"""Model families, one file each; jaxmodels/families.py maps HF `model_type`s to them."""
