"""The registered tasks. fairseq's --user-dir imports every module of this folder."""
