"""Data: the SFT data forms and their validation, the processor interface a model family implements, packing,
batch plans and the demo sets. What a medium becomes is the family's processor (``dhp/models/<family>/``)."""
