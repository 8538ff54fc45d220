"""Teacher-LLM pipeline for Logical Isomer Sets (paper section 3.3 and the appendix
"Prompts for Logical Isomer Construction"): DAG extraction, domain instantiation, quality
verification, the two filters, regeneration, and resumable output."""
