"""Write a GGUF holding only another GGUF's metadata (tokenizer, chat template, config keys)
and no tensors: 1.7 MB for SmolLM2-135M-Instruct's 98 MB file.

`ferrolm convert --synthetic NAME` takes SmolLM2's tokenizer from the default model file
($FERROLM_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf) and reads nothing else from it, so on
the GPU machine this stub in that place lets one device call generate the synthetic 1B
model, where the real file (over one call's 64 MiB) needs two calls made back to back.
scripts/gpu-stage.sh writes it to gpu-bin/tok/. Needs the `gguf` package (pip install gguf).

usage: python3 tools/gpu/tokenizer_gguf.py SOURCE.gguf OUTPUT.gguf
"""
import sys

import gguf


def main(src: str, dst: str) -> None:
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"]
    w = gguf.GGUFWriter(dst, arch=bytes(arch.parts[arch.data[0]]).decode())
    # Written by GGUFWriter itself (or counts that must describe this file, not the source).
    own = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}
    for name, f in r.fields.items():
        if name in own:
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            et = f.types[1]
            if et == gguf.GGUFValueType.STRING:
                val = [bytes(f.parts[i]).decode("utf-8", errors="surrogateescape") for i in f.data]
            else:
                val = [f.parts[i].tolist()[0] for i in f.data]
            w.add_key_value(name, val, vt, sub_type=et)
        elif vt == gguf.GGUFValueType.STRING:
            w.add_key_value(name, bytes(f.parts[f.data[0]]).decode("utf-8", errors="surrogateescape"), vt)
        else:
            w.add_key_value(name, f.parts[f.data[0]].tolist()[0], vt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
