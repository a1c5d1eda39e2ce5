"""vintage modelkit: the model utilities every part shares - weight publication payloads
(``weights``), per-token log-probs under a causal LM (``scoring``) and local model folders
(``modelhub``). It imports only ``protocol`` and third-party libraries, so ``rollout``,
``oldlogit_service`` and ``trainer`` can all import it without a cycle."""
