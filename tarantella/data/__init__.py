"""The data: a tf.data pipeline split across the ranks sample by sample (`pipelines`, with
`file_records` and `rebuild`), the user's inputs as datasets of global batches (`global_batches`),
inputs that Keras' own adapters batch (`keras_batches`), and the orders of a resumed fit's epochs
(`epoch_order`). `tnt.data.distribute` is the one public function.
"""

from tarantella.data.pipelines import distribute

__all__ = ["distribute"]
