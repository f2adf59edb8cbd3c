"""engine-bitsandbytes through the conformance kit: every configuration it supports."""

from engine.testing.kit import QuantizerTests


class TestBitsAndBytes(QuantizerTests):
    plugin = "bitsandbytes"
    quantizer_name = "bitsandbytes"
    configs = {
        "nf4": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bfloat16"},
        "nf4-double-fp32": {
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": "float32",
        },
        "fp4-blocksize-128": {
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "fp4",
            "bnb_4bit_blocksize": 128,
            "bnb_4bit_compute_dtype": "bfloat16",
        },
        "fp4-double": {
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "fp4",
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": "bfloat16",
        },
        "int8": {"load_in_8bit": True},
        "int8-no-outliers": {"load_in_8bit": True, "llm_int8_threshold": 0.0},
    }
