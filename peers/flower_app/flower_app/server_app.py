"""flower-app: the ServerApp, as the Flower template writes it (run peer to peer, it only says how to start)."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from flower_app.task import Net

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""
    fraction_train: float = context.run_config["fraction-train"]
    num_rounds: int = context.run_config["num-server-rounds"]
    lr: float = context.run_config["lr"]

    # Load global model
    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())

    # Initialize FedAvg strategy and run it for `num_rounds`
    strategy = FedAvg(fraction_train=fraction_train)
    result = strategy.start(grid=grid, initial_arrays=arrays, train_config=ConfigRecord({"lr": lr}),
                            num_rounds=num_rounds)

    # Save final model to disk
    torch.save(result.arrays.to_torch_state_dict(), "final_model.pt")
