"""Hidden-state extraction: the target's forward pass, captured layers written as safetensors chunks."""
