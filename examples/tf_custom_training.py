"""TensorFlow's "Custom training with tf.distribute.Strategy" tutorial, in numpy, on Stratagem.

The tutorial's structure, name for name: a model, ``compute_loss`` with TF's loss idiom (the sum of the
per-example losses divided by the *global* batch: ``stratagem.nn.compute_average_loss``), ``train_step``,
``distributed_train_step`` with ``strategy.run`` and ``strategy.reduce(ReduceOp.SUM, ..., axis=None)``,
``experimental_distribute_dataset``, and a test loop. The strategy line is the one change:
``tf.distribute.MirroredStrategy()`` becomes ``stratagem.strategy("mirrored", gradient_reduction="sum")``
(TF's strategies sum the replicas' gradients; Stratagem's default averages them). The model is a small
MLP with hand-written gradients, on a synthetic 4-class problem (no download).

    python3 examples/tf_custom_training.py                                  # one process
    stratagem launch --worker 2 -- python3 examples/tf_custom_training.py   # two replicas: same numbers

``--out FILE`` writes the losses and final weights as JSON (the chief writes it);
tests/test_tf_distribute.py compares one process with 2 replicas within 1e-5.
"""

import argparse
import json

import numpy as np

import stratagem

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--out", help="write the losses and weights here as JSON (on the chief)")
args = parser.parse_args()

strategy = stratagem.strategy("mirrored", gradient_reduction="sum")   # tf.distribute.MirroredStrategy()
print(f"Number of devices: {strategy.num_replicas_in_sync}")

# -- the data: every replica makes the same global batches (TF's tutorial reads Fashion-MNIST) --------
GLOBAL_BATCH_SIZE = 64
FEATURES, CLASSES, HIDDEN = 20, 4, 32
rng = np.random.default_rng(0)
centers = rng.normal(scale=0.4, size=(CLASSES, FEATURES))


def make_examples(n):
    labels = rng.integers(0, CLASSES, size=n)
    images = (centers[labels] + rng.normal(size=(n, FEATURES))).astype(np.float32)
    return images, labels


train_images, train_labels = make_examples(500)           # 7 full global batches and one of 52 rows
test_images, test_labels = make_examples(200)
train_dataset = [(train_images[i:i + GLOBAL_BATCH_SIZE], train_labels[i:i + GLOBAL_BATCH_SIZE])
                 for i in range(0, len(train_images), GLOBAL_BATCH_SIZE)]
test_dataset = [(test_images[i:i + GLOBAL_BATCH_SIZE], test_labels[i:i + GLOBAL_BATCH_SIZE])
                for i in range(0, len(test_images), GLOBAL_BATCH_SIZE)]

# -- the model and the optimizer, created in the strategy's scope ----------------------------------
with strategy.scope():
    init = np.random.default_rng(1)
    w1 = stratagem.Variable((init.normal(size=(FEATURES, HIDDEN)) * 0.1).astype(np.float32), name="w1")
    b1 = stratagem.Variable(np.zeros(HIDDEN, np.float32), name="b1")
    w2 = stratagem.Variable((init.normal(size=(HIDDEN, CLASSES)) * 0.1).astype(np.float32), name="w2")
    b2 = stratagem.Variable(np.zeros(CLASSES, np.float32), name="b2")
    optimizer = stratagem.optimizers.Adam(learning_rate=0.01)


def model(images):
    hidden = np.maximum(images @ w1.value + b1.value, 0)
    return hidden, hidden @ w2.value + b2.value


def per_example_cross_entropy(labels, logits):
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -log_probs[np.arange(len(labels)), labels], np.exp(log_probs)


def compute_loss(labels, logits):
    per_example_loss, _ = per_example_cross_entropy(labels, logits)
    return stratagem.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)


def train_step(inputs):
    images, labels = inputs
    hidden, logits = model(images)
    loss = compute_loss(labels, logits)
    # The gradient of compute_loss (the tape's job in TF): d loss / d logits = (softmax - one-hot) / global batch.
    _, probs = per_example_cross_entropy(labels, logits)
    d_logits = probs
    d_logits[np.arange(len(labels)), labels] -= 1
    d_logits /= GLOBAL_BATCH_SIZE
    d_hidden = (d_logits @ w2.value.T) * (hidden > 0)
    gradients = [images.T @ d_hidden, d_hidden.sum(axis=0), hidden.T @ d_logits, d_logits.sum(axis=0)]
    optimizer.apply_gradients(zip(gradients, [w1, b1, w2, b2]))
    return loss


def test_step(inputs):
    images, labels = inputs
    _, logits = model(images)
    per_example_loss, _ = per_example_cross_entropy(labels, logits)
    correct = float(np.sum(logits.argmax(axis=1) == labels))
    return np.array([per_example_loss.sum(), correct, len(labels)], np.float64)


def distributed_train_step(dataset_inputs):
    per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
    return strategy.reduce(stratagem.ReduceOp.SUM, per_replica_losses, axis=None)


def distributed_test_step(dataset_inputs):
    return strategy.reduce(stratagem.ReduceOp.SUM, strategy.run(test_step, args=(dataset_inputs,)), axis=None)


train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)
history = []
for epoch in range(args.epochs):
    total_loss, num_batches = 0.0, 0
    for x in train_dist_dataset:
        total_loss += distributed_train_step(x)
        num_batches += 1
    train_loss = total_loss / num_batches
    test_loss, correct, seen = sum(distributed_test_step(x) for x in test_dist_dataset)
    history.append([float(train_loss), float(test_loss / seen), float(correct / seen)])
    print(f"Epoch {epoch + 1}, Loss: {train_loss:.6f}, Test Loss: {test_loss / seen:.6f}, "
          f"Test Accuracy: {100 * correct / seen:.2f}")

if args.out and strategy.is_chief:
    with open(args.out, "w") as f:
        json.dump({"replicas": strategy.num_replicas_in_sync, "history": history,
                   "weights": {v.name: v.numpy().astype(float).ravel().tolist() for v in strategy.variables}}, f)
