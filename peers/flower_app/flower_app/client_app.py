"""flower-app: the ClientApp (Message API), as the Flower template writes it."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flower_app.task import Net, load_data
from flower_app.task import test as test_fn
from flower_app.task import train as train_fn

# Flower ClientApp
app = ClientApp()


def _device():
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


@app.train()
def train(msg: Message, context: Context):
    """Train the model on local data."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    trainloader, _ = load_data(context.node_config["partition-id"], context.node_config["num-partitions"],
                               context.run_config)
    train_loss = train_fn(model, trainloader, context.run_config["local-epochs"], msg.content["config"]["lr"],
                          _device())
    model_record = ArrayRecord(model.state_dict())
    metrics = MetricRecord({"train_loss": train_loss, "num-examples": len(trainloader.dataset)})
    return Message(content=RecordDict({"arrays": model_record, "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context):
    """Evaluate the model on local data."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, testloader = load_data(context.node_config["partition-id"], context.node_config["num-partitions"],
                              context.run_config)
    eval_loss, eval_acc = test_fn(model, testloader, _device())
    metrics = MetricRecord({"eval_loss": eval_loss, "eval_acc": eval_acc, "num-examples": len(testloader.dataset)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
