"""Loading models for offload: where the weights are (:mod:`.checkpoint`), GGUF files
(:mod:`.gguf`), Diffusers and transformers models built without weights (:mod:`.meta`,
:mod:`.transformers_models`), building and binding a model (:mod:`.model`), and whole pipelines
(:mod:`.pipeline`). The entry points that use them are in :mod:`ddo.api`."""
