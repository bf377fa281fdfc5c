"""WMT dev and test sets taken from sacrebleu's built-in test sets, so that a model is scored on
exactly the text that ``sacrebleu -t SET -l PAIR`` scores (``--echo src`` is the source read here).

sacrebleu downloads a set once into its cache, ``$SACREBLEU`` (default ``~/.sacrebleu``), laid out
as ``<set>/raw/<archive>`` plus the unpacked archive, and writes plain-text files
``<set>/<set>.<pair>.{src,ref,docid,...}`` beside it. A machine without network needs that cache
filled beforehand (copy ``~/.sacrebleu`` from a machine that has run ``sacrebleu -t SET -l PAIR
--echo src`` once).
"""

from typing import Dict

from .common import Split
from .download import DownloadFailed
from .readers import read_plain


def sacrebleu_split(test_set: str, langpair: str) -> Split:
    """Source, reference and document ids of one sacrebleu test set (downloaded when missing)."""
    from sacrebleu.dataset import DATASETS
    from sacrebleu.utils import SACREBLEU_DIR

    if test_set not in DATASETS:
        raise ValueError(f"sacrebleu has no test set {test_set!r}")
    dataset = DATASETS[test_set]
    if langpair not in dataset.langpairs:
        raise ValueError(f"sacrebleu's {test_set} has no language pair {langpair} "
                         f"(it has {', '.join(sorted(dataset.langpairs))})")
    try:
        files: Dict[str, str] = dict(zip(dataset.fieldnames(langpair), dataset.get_files(langpair)))
    except (OSError, SystemExit) as err:  # no network: urllib's URLError is an OSError
        raise DownloadFailed(  # one line from the console commands, as for the corpus archives
            f"sacrebleu could not provide {test_set} {langpair} in {SACREBLEU_DIR} ({err}); "
            f"run 'sacrebleu -t {test_set} -l {langpair} --echo src' on a machine with network "
            "and copy its cache there (the SACREBLEU environment variable names the folder)"
        ) from err
    refs = [name for name in files if name.startswith("ref")]
    if len(refs) != 1:
        raise ValueError(f"{test_set} {langpair} has {len(refs)} references; one is expected")
    docids = read_plain(files["docid"]) if "docid" in files else None
    return Split(read_plain(files["src"]), read_plain(files[refs[0]]), docids,
                 origin=f"sacrebleu -t {test_set} -l {langpair}")
